// Readiness probe used by scripts/brokers.sh (run as a single-file source program:
// `java -cp '<kafka libs>/*' KafkaReady.java 127.0.0.1:9092`). Exits 0 once the broker
// serves cluster metadata (describeCluster + listTopics), non-zero otherwise.
import java.util.Properties;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;

public class KafkaReady {
    public static void main(String[] args) throws Exception {
        Properties p = new Properties();
        p.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        p.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "30000");
        p.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "10000");
        try (Admin admin = Admin.create(p)) {
            int nodes = admin.describeCluster().nodes().get(30, TimeUnit.SECONDS).size();
            admin.listTopics().names().get(30, TimeUnit.SECONDS);
            System.out.println("kafka ready: " + nodes + " broker(s) serving metadata");
            System.exit(nodes > 0 ? 0 : 1);
        }
    }
}
