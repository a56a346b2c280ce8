// txoutbox's SQL contract from Java (JDBC, PostgreSQL's driver), run by outbox's
// TestSQLProducerJava: java -cp postgresql.jar Producer.java. TXOUTBOX_JDBC_URL says where to
// connect (with currentSchema=<the outbox schema>, so that the functions are on the path).

import java.nio.charset.StandardCharsets;
import java.sql.Array;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.util.ArrayList;
import java.util.List;
import java.util.UUID;

public class Producer {
    // snippet:java
    // Marks the order created and enqueues its event, in one transaction.
    static UUID placeOrder(Connection conn, int orderId) throws SQLException {
        UUID id;
        conn.setAutoCommit(false);
        try (PreparedStatement upd = conn.prepareStatement("UPDATE orders SET status = 'created' WHERE id = ?");
             PreparedStatement enq = conn.prepareStatement(
                 "SELECT txoutbox_enqueue(subject => ?, payload => ?, key => ?, headers => ?::jsonb, biz_key => ?)")) {
            upd.setInt(1, orderId);
            upd.executeUpdate();
            enq.setString(1, "orders.created");
            enq.setBytes(2, ("{\"order\": " + orderId + "}").getBytes(StandardCharsets.UTF_8));
            enq.setString(3, "order-" + orderId);
            enq.setString(4, "{\"traceparent\": [\"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"]}");
            enq.setString(5, "order:" + orderId + ":created");
            try (ResultSet rs = enq.executeQuery()) {
                rs.next();
                id = rs.getObject(1, UUID.class);
            }
            conn.commit();
        } catch (SQLException e) {
            conn.rollback();
            throw e;
        } finally {
            conn.setAutoCommit(true);
        }
        ringDoorbell(conn); // after the commit: wake the relay
        return id;
    }

    // Enqueues one event per order, in order, in one round trip.
    static UUID[] shipOrders(Connection conn, int... orderIds) throws SQLException {
        String[] subjects = new String[orderIds.length];
        byte[][] payloads = new byte[orderIds.length][];
        String[] keys = new String[orderIds.length];
        for (int i = 0; i < orderIds.length; i++) {
            subjects[i] = "orders.shipped";
            payloads[i] = ("{\"order\": " + orderIds[i] + "}").getBytes(StandardCharsets.UTF_8);
            keys[i] = "order-" + orderIds[i];
        }
        UUID[] ids;
        conn.setAutoCommit(false);
        try (PreparedStatement enq = conn.prepareStatement(
                "SELECT txoutbox_enqueue_many(subjects => ?, payloads => ?, keys => ?)")) {
            enq.setArray(1, conn.createArrayOf("text", subjects));
            enq.setArray(2, conn.createArrayOf("bytea", payloads));
            enq.setArray(3, conn.createArrayOf("text", keys));
            try (ResultSet rs = enq.executeQuery()) {
                rs.next();
                ids = (UUID[]) rs.getArray(1).getArray();
            }
            conn.commit();
        } catch (SQLException e) {
            conn.rollback();
            throw e;
        } finally {
            conn.setAutoCommit(true);
        }
        ringDoorbell(conn);
        return ids;
    }

    // A half message: stored first (autocommit), committed with the business change.
    static UUID payOrder(Connection conn, int orderId) throws SQLException {
        UUID halfId;
        try (PreparedStatement prep = conn.prepareStatement(
                "SELECT txoutbox_prepare(?, ?, key => ?, producer_group => 'payments')")) {
            prep.setString(1, "orders.paid");
            prep.setBytes(2, ("{\"order\": " + orderId + "}").getBytes(StandardCharsets.UTF_8));
            prep.setString(3, "order-" + orderId);
            try (ResultSet rs = prep.executeQuery()) {
                rs.next();
                halfId = rs.getObject(1, UUID.class);
            }
        }
        conn.setAutoCommit(false);
        try (PreparedStatement upd = conn.prepareStatement("UPDATE orders SET status = 'paid' WHERE id = ?");
             PreparedStatement commit = conn.prepareStatement("SELECT txoutbox_commit_in_tx(?)")) {
            upd.setInt(1, orderId);
            upd.executeUpdate();
            commit.setObject(1, halfId);
            commit.executeQuery().close();
            conn.commit();
        } catch (SQLException e) {
            conn.rollback();
            throw e;
        } finally {
            conn.setAutoCommit(true);
        }
        ringDoorbell(conn);
        return halfId;
    }

    // The message id, or null when txoutbox refuses the message (SQLSTATE class TX).
    static UUID tryEnqueue(Connection conn, String subject, byte[] payload) throws SQLException {
        try (PreparedStatement enq = conn.prepareStatement("SELECT txoutbox_enqueue(?, ?)")) {
            enq.setString(1, subject);
            enq.setBytes(2, payload);
            try (ResultSet rs = enq.executeQuery()) {
                rs.next();
                return rs.getObject(1, UUID.class);
            }
        } catch (SQLException e) {
            if (e.getSQLState() == null || !e.getSQLState().startsWith("TX")) {
                throw e;
            }
            System.err.println("refused " + e.getSQLState() + ": " + e.getMessage());
            return null;
        }
    }

    static void ringDoorbell(Connection conn) throws SQLException {
        try (Statement st = conn.createStatement()) {
            st.execute("SELECT pg_notify('txoutbox_doorbell', '')");
        }
    }
    // snippet:end

    public static void main(String[] args) throws Exception {
        try (Connection conn = DriverManager.getConnection(System.getenv("TXOUTBOX_JDBC_URL"))) {
            System.out.println("enqueued " + placeOrder(conn, 42));
            List<String> many = new ArrayList<>();
            for (UUID id : shipOrders(conn, 1, 2, 3)) {
                many.add(id.toString());
            }
            System.out.println("many " + String.join(",", many));
            System.out.println("half " + payOrder(conn, 7));
            try (Statement st = conn.createStatement()) {
                st.executeQuery("SELECT txoutbox_enqueue('orders..created', '')").close();
            } catch (SQLException e) {
                System.out.println("refused " + e.getSQLState());
            }
            System.out.println("try_enqueue " + tryEnqueue(conn, "orders.*", "{}".getBytes(StandardCharsets.UTF_8)));
        }
    }
}
