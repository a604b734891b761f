// Readiness probe used by scripts/brokers.sh (compiled once into its cache by kafka_ready; also runs as a
// single-file source program):
//   java -cp '<kafka libs>/*' KafkaReady.java 127.0.0.1:9092
//       exits 0 once the broker serves cluster metadata (describeCluster + listTopics);
//   java -cp '<kafka libs>/*' KafkaReady.java BOOTSTRAP --brokers N [--topic T] [--in-isr ID] [--timeout S]
//       exits 0 once N brokers are registered, then (--topic) topic T exists with replication factor N
//       and a record written to it with acks=all is acknowledged, then (--in-isr) broker ID is registered
//       and in the in-sync replica set of every partition it holds. Each step is retried until S seconds
//       (120) pass.
import java.util.ArrayList;
import java.util.Collection;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Properties;
import java.util.Set;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.ListTopicsOptions;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.Node;
import org.apache.kafka.common.TopicPartitionInfo;
import org.apache.kafka.common.errors.TopicExistsException;
import org.apache.kafka.common.serialization.StringSerializer;

public class KafkaReady {
    interface Step {
        String check() throws Exception;  // null when done, else what is still missing
    }

    static long deadline;

    public static void main(String[] args) throws Exception {
        String bootstrap = args[0];
        int brokers = 0;
        String topic = null;
        Integer inIsr = null;
        long timeoutS = 120;
        for (int i = 1; i < args.length; i += 2) {
            switch (args[i]) {
                case "--brokers" -> brokers = Integer.parseInt(args[i + 1]);
                case "--topic" -> topic = args[i + 1];
                case "--in-isr" -> inIsr = Integer.parseInt(args[i + 1]);
                case "--timeout" -> timeoutS = Long.parseLong(args[i + 1]);
                default -> throw new IllegalArgumentException("unknown option " + args[i]);
            }
        }
        deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(timeoutS);
        Properties p = new Properties();
        p.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "30000");
        p.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "10000");
        try (Admin admin = Admin.create(p)) {
            if (brokers == 0 && topic == null && inIsr == null) {
                int nodes = admin.describeCluster().nodes().get(30, TimeUnit.SECONDS).size();
                admin.listTopics().names().get(30, TimeUnit.SECONDS);
                System.out.println("kafka ready: " + nodes + " broker(s) serving metadata");
                System.exit(nodes > 0 ? 0 : 1);
            }
            final int n = brokers;
            await("brokers registered", () -> {
                Collection<Node> nodes = admin.describeCluster().nodes().get(10, TimeUnit.SECONDS);
                return nodes.size() >= n ? null : nodes.size() + " of " + n + " brokers registered: " + nodes;
            });
            if (topic != null) {
                final String t = topic;
                await("topic " + t + " created", () -> create(admin, t, n));
                await("a record written to " + t + " with acks=all", () -> write(bootstrap, t));
            }
            if (inIsr != null) {
                final int id = inIsr;
                await("broker " + id + " registered", () -> {
                    Collection<Node> nodes = admin.describeCluster().nodes().get(10, TimeUnit.SECONDS);
                    return nodes.stream().anyMatch(node -> node.id() == id) ? null : "registered: " + nodes;
                });
                await("broker " + id + " in sync", () -> outOfSync(admin, id));
            }
        }
        System.out.println("kafka cluster ready: at least " + brokers + " broker(s)" + (topic != null ? ", " + topic + " writable" : "")
                + (inIsr != null ? ", broker " + inIsr + " in every ISR it belongs to" : ""));
    }

    static void await(String what, Step step) throws InterruptedException {
        String missing;
        do {
            try {
                missing = step.check();
            } catch (Exception e) {
                missing = e.toString();
            }
            if (missing == null) {
                return;
            }
            Thread.sleep(500);
        } while (System.nanoTime() < deadline);
        System.err.println("kafka cluster not ready: " + what + ": " + missing);
        System.exit(1);
    }

    static String create(Admin admin, String topic, int replicas) throws Exception {
        NewTopic spec = new NewTopic(topic, Optional.of(1), Optional.of((short) replicas))
                .configs(Map.of("min.insync.replicas", String.valueOf(Math.max(1, replicas - 1))));
        try {
            admin.createTopics(List.of(spec)).all().get(10, TimeUnit.SECONDS);
        } catch (ExecutionException e) {
            if (!(e.getCause() instanceof TopicExistsException)) {
                throw e;
            }
        }
        TopicDescription d = admin.describeTopics(List.of(topic)).allTopicNames().get(10, TimeUnit.SECONDS).get(topic);
        int rf = d.partitions().get(0).replicas().size();
        return rf == replicas ? null : "replication factor " + rf + ", not " + replicas;
    }

    static String write(String bootstrap, String topic) throws Exception {
        Properties p = new Properties();
        p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        p.put(ProducerConfig.ACKS_CONFIG, "all");
        p.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
        p.put(ProducerConfig.DELIVERY_TIMEOUT_MS_CONFIG, "15000");
        p.put(ProducerConfig.REQUEST_TIMEOUT_MS_CONFIG, "10000");
        p.put(ProducerConfig.MAX_BLOCK_MS_CONFIG, "10000");
        p.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
        p.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(p)) {
            producer.send(new ProducerRecord<>(topic, "ready")).get(20, TimeUnit.SECONDS);
        }
        return null;
    }

    static String outOfSync(Admin admin, int id) throws Exception {
        Set<String> topics = admin.listTopics(new ListTopicsOptions().listInternal(true)).names().get(10, TimeUnit.SECONDS);
        List<String> missing = new ArrayList<>();
        for (TopicDescription d : admin.describeTopics(topics).allTopicNames().get(10, TimeUnit.SECONDS).values()) {
            for (TopicPartitionInfo tp : d.partitions()) {
                boolean replica = tp.replicas().stream().anyMatch(r -> r.id() == id);
                if (replica && tp.isr().stream().noneMatch(r -> r.id() == id)) {
                    missing.add(d.name() + "-" + tp.partition());
                }
            }
        }
        return missing.isEmpty() ? null : "not in the ISR of " + missing;
    }
}
