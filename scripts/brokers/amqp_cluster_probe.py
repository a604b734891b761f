"""Readiness probe of the RabbitMQ cluster: a quorum queue declared, then published to with confirms
through every node and its messages counted (run by scripts/brokers/rabbit_cluster.sh; needs pika)."""

import sys

import pika

QUEUE = "tensorbus-cluster-probe"


def main(ports: list[int]) -> None:
    for n, port in enumerate(ports):
        params = pika.ConnectionParameters("127.0.0.1", port, connection_attempts=10, retry_delay=1)
        with pika.BlockingConnection(params) as connection:
            channel = connection.channel()
            channel.confirm_delivery()
            if n == 0:
                channel.queue_delete(QUEUE)
            declared = channel.queue_declare(QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
            assert declared.method.message_count == n, f"{declared.method.message_count} messages, expected {n}"
            channel.basic_publish("", QUEUE, f"probe {port}".encode(), mandatory=True)
            if n == len(ports) - 1:
                channel.queue_delete(QUEUE)
        print(f"127.0.0.1:{port}: quorum queue {QUEUE} declared and published to")


if __name__ == "__main__":
    main([int(port) for port in sys.argv[1:]])
