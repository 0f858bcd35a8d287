-- The operator audit trail: who did what to which subject, and why.

-- name: insert_audit
INSERT INTO ferry_audit (at, actor, action, subject, reason)
VALUES ({now $1}, $2, $3, $4, $5)
