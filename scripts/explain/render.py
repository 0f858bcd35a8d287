"""Prints one query of Ferry's templated SQL rendered for PostgreSQL, as
ferry-sqlgen renders it at build time, for the scripts in scripts/explain/:
its fragments inlined (with their parameters renumbered; fragments are
looked up in every FILE given, as a crate borrows the library's) and the
template tokens it uses ({now $N}, {least}, {greatest}, {pg:...}, {sqlite:...}) replaced.

    python3 render.py QUERY FILE.sql [FILE.sql...]

QUERY is the shared section, else its [postgres] override, else its
[postgres only] one."""
import re
import sys

sections = {}
for path in sys.argv[2:]:
    name = None
    for line in open(path).read().splitlines():
        m = re.match(r"-- name: (\w+)(?: \[(.*)\])?", line)
        if m:
            name = (m.group(1), m.group(2) or "")
            sections[name] = []
        elif name is not None:
            sections[name].append(line)


def body(key):
    lines = [l for l in sections[key] if not l.lstrip().startswith("--")]
    return "\n".join(lines).strip()


def render(sql):
    def use(m):
        args = m.group(2).split()
        frag = body((m.group(1), "fragment"))
        # Renumber the fragment's $1.. to the arguments given.
        return re.sub(r"\$(\d+)", lambda p: "\x00" + args[int(p.group(1)) - 1][1:], frag)

    while "{use " in sql:
        sql = re.sub(r"\{use (\w+)((?: \$\d+)*)\}", use, sql).replace("\x00", "$")
    sql = re.sub(r"\{now (\$\d+)\}", r"COALESCE(\1::bigint, (extract(epoch FROM now()) * 1000)::bigint)", sql)
    sql = sql.replace("{least}", "LEAST").replace("{greatest}", "GREATEST")
    sql = re.sub(r"\{pg:([^}]*)\}", r"\1", sql)
    sql = re.sub(r"\{sqlite:([^}]*)\}", "", sql)
    if "{" in re.sub(r"'[^']*'", "", sql):
        sys.exit("render.py: a template token it does not know")
    return sql


query = sys.argv[1]
for tag in ("", "postgres", "postgres only"):
    if (query, tag) in sections:
        print(render(body((query, tag))))
        break
else:
    sys.exit(f"render.py: no query {query}")
