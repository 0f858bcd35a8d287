#!/usr/bin/env python3
"""Checks the user-facing docs (README.md, BENCHMARKS.md, the book in docs/).

  - every relative link resolves: the file exists, and an anchor names a
    heading of its target (mdBook's ids: lowercase, spaces to `-`, only
    letters, digits, `-` and `_` kept);
  - every chapter of docs/ is in docs/SUMMARY.md and every SUMMARY entry
    exists (nothing unreachable from the table of contents);
  - every chapter with Rust examples is compiled as doctests
    (cli/src/lib.rs includes it), so its snippets stay true;
  - every test named in docs/guarantees.md exists as a function;
  - no internal issue number (`issue #12`, `(#21)`) in README, BENCHMARKS or
    the book: ARCHITECTURE.md is the contributors' map;
  - with --run, every ```sh block not marked `sh,no_run` runs (bash -e, from
    the repository root, the debug binaries first on PATH): a stale command
    fails the build.

Exits non-zero naming each problem.
"""

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
ISSUE = re.compile(r"[Ii]ssues? #\d+|\(#\d+\)|stop \d+")
problems = []


def rel(path):
    return os.path.relpath(path, ROOT)


def prose(text):
    """The lines outside fenced code blocks, inline code removed."""
    fence = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield n, re.sub(r"`[^`]*`", "", line)


def blocks(text):
    """(info string, first line number, body) of each fenced block."""
    out, info, start, body = [], None, 0, []
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            if info is None:
                info, start, body = line[3:].strip(), n, []
            else:
                out.append((info, start, "\n".join(body)))
                info = None
        elif info is not None:
            body.append(line)
    return out


def heading_ids(path):
    """mdBook's ids of the headings of `path` (inline code kept as text)."""
    ids, fence = set(), False
    for line in open(path).read().split("\n"):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            m = re.match(r"^#{1,6} (.*)$", line)
            if m:
                ids.add(normalize(m.group(1)))
    return ids


def normalize(heading):
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return "".join(c if c.isalnum() or c in "-_" else "-" if c.isspace() else "" for c in text)


def user_docs():
    files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "BENCHMARKS.md")]
    files += sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
    return files


def check_links(path):
    for n, line in prose(open(path).read()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(dest):
                problems.append(f"{rel(path)}:{n}: link to {target}: {rel(dest)} does not exist")
                continue
            if anchor and dest.endswith(".md") and anchor not in heading_ids(dest):
                problems.append(f"{rel(path)}:{n}: link to {target}: no heading #{anchor} in {rel(dest)}")


def check_summary():
    summary = os.path.join(DOCS, "SUMMARY.md")
    listed = set()
    for n, line in prose(open(summary).read()):
        for target in LINK.findall(line):
            dest = os.path.normpath(os.path.join(DOCS, target))
            listed.add(dest)
            if not os.path.exists(dest):
                problems.append(f"docs/SUMMARY.md:{n}: {target} does not exist")
    for chapter in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True):
        if chapter != summary and chapter not in listed:
            problems.append(f"{rel(chapter)} is not in docs/SUMMARY.md: no reader can reach it")


def check_doctests():
    lib = open(os.path.join(ROOT, "cli", "src", "lib.rs")).read()
    for chapter in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True):
        if any(info.startswith("rust") for info, _, _ in blocks(open(chapter).read())):
            include = f'include_str!("../../{rel(chapter)}")'
            if include not in lib:
                problems.append(f"{rel(chapter)} has Rust examples that no doctest compiles: add {include} to cli/src/lib.rs")


def check_guarantees():
    sources = []
    for pattern in ("tests/**/*.rs", "*/tests/**/*.rs"):
        sources += glob.glob(os.path.join(ROOT, pattern), recursive=True)
    defined = set()
    for src in sources:
        defined.update(re.findall(r"\bfn ([a-z0-9_]+)\s*[(<]", open(src).read()))
    text = open(os.path.join(DOCS, "guarantees.md")).read()
    for n, line in enumerate(text.split("\n"), 1):
        if not line.startswith("|"):
            continue
        for name in re.findall(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`", line):
            if name not in defined:
                problems.append(f"docs/guarantees.md:{n}: no test named {name}")


def check_issue_numbers(path):
    for n, line in prose(open(path).read()):
        m = ISSUE.search(line)
        if m:
            problems.append(f"{rel(path)}:{n}: internal issue number in user-facing docs: {m.group(0)!r}")


def run_commands():
    # As a reader runs them: on embedded defaults, not the test command's
    # DATABASE_URL or FERRY_* settings (a command that needs a service says
    # so itself).
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith("FERRY_")}
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    env["PATH"] = os.path.join(target, "debug") + os.pathsep + env.get("PATH", "")
    seen = set()
    for path in user_docs():
        for info, start, body in blocks(open(path).read()):
            words = info.split(",")
            if words[0] != "sh" or "no_run" in words[1:] or body in seen:
                continue
            seen.add(body)
            print(f"check-docs: running {rel(path)}:{start}", flush=True)
            # `cargo run` of a binary or example the test build already
            # made runs that build's executable (a `cargo run -p` alone
            # would build its package again with other features).
            script = re.sub(r"cargo run -p [\w-]+ --bin ([\w-]+) --", r"\1", body)
            script = re.sub(r"cargo run --example ([\w-]+)", os.path.join(target, "debug", "examples", r"\1"), script)
            p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if p.returncode != 0:
                problems.append(f"{rel(path)}:{start}: the command failed ({p.returncode}):\n{body}\n{p.stdout[-3000:]}")


def main():
    for path in user_docs():
        check_links(path)
        check_issue_numbers(path)
    check_summary()
    check_doctests()
    check_guarantees()
    if "--run" in sys.argv[1:]:
        run_commands()
    for p in problems:
        print(f"check-docs: {p}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"check-docs: {len(user_docs())} files, links, the table of contents, doctests and named tests check")


if __name__ == "__main__":
    main()
