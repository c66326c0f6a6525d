-- Named queries on the outbox table. Each starts with `-- name: <name>` and a line saying what
-- it does. {table} is the validated, schema-qualified table name; :params are bind parameters.

-- name: lease_ids
-- Lease the given pending rows to one sender; rows another sender holds are left alone.
UPDATE {table}
   SET lease_owner = :owner,
       lease_until = now() + make_interval(secs => :lease_seconds)
 WHERE id = ANY(:ids)
   AND status = 'pending'
   AND (lease_until IS NULL OR lease_until < now())
   AND (next_attempt_at IS NULL OR next_attempt_at <= now())
RETURNING id, seq, shard, topic, key, value, content_type, header_names, header_values, created_at;

-- name: leased_behind_earlier
-- Of the rows this sender leased, those whose key still has an earlier pending row that the
-- sender does not hold: sending them now would overtake it.
SELECT c.id
  FROM {table} AS c
 WHERE c.id = ANY(:ids)
   AND c.key IS NOT NULL
   AND EXISTS (
       SELECT 1
         FROM {table} AS p
        WHERE p.status = 'pending'
          AND p.shard = c.shard
          AND p.seq < c.seq
          AND p.topic = c.topic
          AND p.key = c.key
          AND p.lease_owner IS DISTINCT FROM :owner);

-- name: release
-- Give leased rows back, untouched, for the relay to send.
UPDATE {table}
   SET lease_owner = NULL, lease_until = NULL
 WHERE id = ANY(:ids) AND lease_owner = :owner;

-- name: mark_sent
-- Record Kafka's acknowledgement (partition, offset) of leased rows.
UPDATE {table} AS o
   SET status = 'sent',
       sent_at = now(),
       kafka_partition = acked.kafka_partition,
       kafka_offset = acked.kafka_offset,
       attempts = o.attempts + 1,
       lease_owner = NULL,
       lease_until = NULL,
       error_kind = NULL,
       last_error = NULL
  FROM unnest(CAST(:ids AS uuid[]), CAST(:partitions AS int[]), CAST(:offsets AS bigint[]))
       AS acked (id, kafka_partition, kafka_offset)
 WHERE o.id = acked.id AND o.lease_owner = :owner;

-- name: delete_sent
-- Keep-nothing retention: drop leased rows once Kafka acknowledged them.
DELETE FROM {table}
 WHERE id = ANY(:ids) AND lease_owner = :owner;

-- name: purge_sent
-- Delete one batch of sent rows created and sent before the cutoff (the UUIDv7 id bounds
-- the creation time, so the primary key index finds them).
WITH doomed AS (
    SELECT id
      FROM {table}
     WHERE id < :cutoff_id
       AND status = 'sent'
       AND sent_at < :cutoff
     ORDER BY id
     LIMIT :batch_size
       FOR UPDATE SKIP LOCKED)
DELETE FROM {table} AS o
 USING doomed
 WHERE o.id = doomed.id;
