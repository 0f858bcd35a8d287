-- The rows whose records are in the golden files: one session, several
-- transactions. Debezium's recommended pattern (insert, then delete in the
-- same transaction) included; an update and a rolled-back insert, which
-- neither relay publishes.
BEGIN;
INSERT INTO outbox_event VALUES
  ('9a0c1f3e-0000-4000-8000-000000000001', 'Order', 'o-1', 'OrderCreated',
   '{"id": 1, "lines": [1, 2, 3], "total": 99.5, "note": "a \"quoted\" é\n\tline/\u0001", "coupon": null,
     "customer": {"name": "Zoë", "vip": true, "score": 1e-5, "big": 3000000000, "neg": -7}}',
   'acme', 1, '2026-12-05 07:54:07.120000+00'),
  ('9a0c1f3e-0000-4000-8000-000000000002', 'Order', 'o-2', 'OrderCreated', '{}', 'acme', 1,
   '2026-12-05 07:54:08+01');
COMMIT;

BEGIN;
INSERT INTO outbox_event VALUES
  ('9a0c1f3e-0000-4000-8000-000000000003', 'Customer', 'c-7', 'CustomerRegistered',
   '{"email": "c7@example.com", "tags": ["a", "b"], "age": 41, "weight": 70.0, "ratio": 12345678.9, "tiny": 0.00012}',
   'globex', NULL, '2026-12-05 07:54:09.000001+00');
DELETE FROM outbox_event WHERE id = '9a0c1f3e-0000-4000-8000-000000000003';
COMMIT;

BEGIN;
INSERT INTO outbox_event VALUES
  ('9a0c1f3e-0000-4000-8000-000000000004', 'Order', 'o-1', 'OrderPaid', '{"amount": -12.25, "paid": false}',
   NULL, 2, NULL),
  ('9a0c1f3e-0000-4000-8000-000000000005', 'Order', 'o-1', 'OrderShipped', NULL, 'acme', 3,
   '1999-12-31 23:59:59.5-05'),
  ('9a0c1f3e-0000-4000-8000-000000000006', 'Shipment', 's-1', 'Dispatched',
   '{"a": [], "b": {"c": {}}, "n": [null, 1]}', 'acme', 1, '2026-01-01 00:00:00+00');
UPDATE outbox_event SET type = 'Changed' WHERE id = '9a0c1f3e-0000-4000-8000-000000000001';
COMMIT;

BEGIN;
INSERT INTO outbox_event VALUES
  ('9a0c1f3e-0000-4000-8000-000000000099', 'Order', 'o-9', 'Never', '{}', 'acme', 1, NULL);
ROLLBACK;

BEGIN;
INSERT INTO domain_events VALUES
  ('7b1d2e4f-0000-4000-8000-000000000011', 'billing.invoices', 'inv-1', 'InvoiceIssued', 1, '\x68656c6c6f', true),
  ('7b1d2e4f-0000-4000-8000-000000000012', 'billing.invoices', 'inv-2', 'InvoiceVoided', 2, '\x00ff', false),
  ('7b1d2e4f-0000-4000-8000-000000000013', 'shipping', 's-9', 'Sent', 3, NULL, true);
DELETE FROM domain_events;
COMMIT;

BEGIN;
INSERT INTO domain_events VALUES
  ('7b1d2e4f-0000-4000-8000-000000000014', 'billing.refunds', 'inv-1', 'Refunded', 4, '\x', true);
COMMIT;
