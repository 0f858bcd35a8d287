"""Prints complete_batch of sql/jobs.sql rendered for PostgreSQL, as
ferry-sqlgen renders it at build time, for scripts/explain/complete-cost:
its fragments inlined (with their parameters renumbered) and the template
tokens it uses ({now $N}, {least}, {greatest}, {pg:...}) replaced."""
import re
import sys

sections = {}
name = None
for line in open(sys.argv[1]).read().splitlines():
    m = re.match(r"-- name: (\w+)(?: \[(.*)\])?", line)
    if m:
        name = (m.group(1), m.group(2) or "")
        sections[name] = []
    elif name is not None:
        sections[name].append(line)


def body(key):
    lines = [l for l in sections[key] if not l.startswith("--")]
    return "\n".join(lines).strip()


def render(sql):
    def use(m):
        args = m.group(2).split()
        frag = body((m.group(1), "fragment"))
        # Renumber the fragment's $1.. to the arguments given.
        return re.sub(r"\$(\d+)", lambda p: "\x00" + args[int(p.group(1)) - 1][1:], frag)

    sql = re.sub(r"\{use (\w+)((?: \$\d+)*)\}", use, sql).replace("\x00", "$")
    sql = re.sub(r"\{now (\$\d+)\}", r"COALESCE(\1::bigint, (extract(epoch FROM now()) * 1000)::bigint)", sql)
    sql = sql.replace("{least}", "LEAST").replace("{greatest}", "GREATEST")
    sql = re.sub(r"\{pg:([^}]*)\}", r"\1", sql)
    if "{" in re.sub(r"'[^']*'", "", sql):
        sys.exit("complete-cost.py: a template token it does not know")
    return sql


print(render(body(("complete_batch", "postgres only"))))
