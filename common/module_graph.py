#!/usr/bin/env python3
"""The module import graph of `distlab-common` and its cycles.

    python3 common/module_graph.py [common/src]

Reads every `use crate::...` / `super::` / `self::` / child-module path and every
`crate::x::y` path in code (tests, `#[cfg(test)]` items and comments left out), resolves
it through re-exports (`pub use`, globs) to the file module that defines the item, and
prints each file module's imports, then the cycles: among file modules, and among the
domain folders (a module's first path segment). Edges between a module and its own
ancestors (a folder's `mod.rs` and its children) are not counted. Exits 1 on a cycle.
"""

import os
import re
import sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "src")

ITEM = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+fn|async\s+fn|unsafe\s+fn|fn|struct|enum|trait|type|const|static|mod|union)\s+(\w+)",
    re.M,
)
USE = re.compile(r"^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.M)
PATH = re.compile(r"(?<![\w:])((?:crate|super|self)(?:::\w+)+|\w+(?:::\w+)+)")


def module_of(path):
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] in ("lib", "mod"):
        rel = rel[:-1]
    return tuple(rel)


def strip(text):
    """Comments and strings blanked, `#[cfg(test)]` items dropped."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i)
            i = n if j < 0 else j + 2
        elif text.startswith('r#"', i):
            j = text.find('"#', i + 3)
            out.append('""')
            i = n if j < 0 else j + 2
        elif text[i] == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            i = j + 1
        elif text[i] == "'" and re.match(r"'(\\.|[^\\'])'", text[i : i + 4]):
            k = re.match(r"'(\\.|[^\\'])'", text[i : i + 4]).end()
            out.append("' '")
            i += k
        else:
            out.append(text[i])
            i += 1
    code = "".join(out)
    # drop #[cfg(test)] items: up to the end of their `;` or their braces
    while True:
        m = re.search(r"#\[cfg\(test\)\]", code)
        if not m:
            return code
        j = m.end()
        depth, k = 0, j
        while k < len(code):
            c = code[k]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    k += 1
                    break
            elif c == ";" and depth == 0:
                k += 1
                break
            k += 1
        code = code[: m.start()] + code[k:]


def expand(tree):
    """`a::{b, c::{d, e as f}, self}` -> [(segments, alias)]"""
    tree = re.sub(r"\s+", "", tree)
    result = []

    def walk(prefix, t):
        parts, depth, cur = [], 0, ""
        for c in t:
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            if c == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += c
        if cur:
            parts.append(cur)
        for p in parts:
            if "{" in p:
                head, rest = p.split("{", 1)
                walk(prefix + [s for s in head.split("::") if s], rest[:-1])
            else:
                alias = None
                if "@" in p:
                    p, alias = p.split("@")
                segs = p.split("::")
                if segs[-1] == "self":
                    segs = segs[:-1]
                    alias = alias or (prefix + segs)[-1]
                result.append((prefix + segs, alias or segs[-1]))

    walk([], tree)
    return result


class Module:
    def __init__(self, path, code):
        self.path = path
        self.items = set(ITEM.findall(code))
        self.uses = []  # (segments, alias, is_pub)
        for m in USE.finditer(code):
            raw = m.group(2)
            raw = re.sub(r"\s+as\s+", "@", raw)  # `x as y`, before expand() drops spaces
            for segs, alias in expand(raw):
                self.uses.append((segs, alias, bool(m.group(1))))
        self.body = USE.sub("", code)


def load():
    mods = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".rs"):
                p = os.path.join(dirpath, f)
                with open(p) as fh:
                    mods[module_of(p)] = Module(module_of(p), strip(fh.read()))
    # modules only reachable from #[cfg(test)] `mod x;` declarations are test code
    declared = {(): True}
    for path, m in mods.items():
        for name in m.items:
            declared[path + (name,)] = True
    return {p: m for p, m in mods.items() if p in declared}


def absolute(mods, here, segs):
    """Segments of a path written in module `here`, made absolute (None: external)."""
    if not segs:
        return None
    if segs[0] == "crate":
        return list(segs[1:])
    if segs[0] in ("super", "self"):
        base = list(here)
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
        return base + list(segs)
    if here + (segs[0],) in mods:  # a child module named without `self::`
        return list(here) + list(segs)
    return None


def resolve(mods, segs, seen=None):
    """The file module that defines what absolute path `segs` names."""
    seen = seen or set()
    cur = ()
    for i, s in enumerate(segs):
        if s == "*":
            return cur
        if cur + (s,) in mods:
            cur = cur + (s,)
            continue
        key = (cur, s)
        if key in seen:
            return None
        seen.add(key)
        m = mods[cur]
        if s in m.items:
            return cur
        for useg, alias, _ in m.uses:
            if alias == s and useg[-1] != "*":
                target = absolute(mods, cur, useg)
                if target is not None:
                    return resolve(mods, target, seen)
        for useg, alias, _ in m.uses:
            if useg[-1] == "*":
                target = absolute(mods, cur, useg[:-1])
                if target is None:
                    continue
                base = resolve(mods, target, seen)
                if base is not None and base in mods:
                    found = resolve(mods, list(base) + [s], seen)
                    if found is not None:
                        return found
        return None
    return cur


def globbed(mods, module, seen=None):
    """The modules whose items `module` re-exports by `pub use x::*`, transitively."""
    seen = seen if seen is not None else set()
    for segs, _, public in mods[module].uses:
        if public and segs[-1] == "*":
            a = absolute(mods, module, segs[:-1])
            t = resolve(mods, a) if a is not None else None
            if t is not None and t not in seen:
                seen.add(t)
                globbed(mods, t, seen)
    return seen


def edges(mods):
    graph = {p: set() for p in mods}
    for here, m in mods.items():
        aliases = {}
        targets = []
        for segs, alias, _ in m.uses:
            a = absolute(mods, here, segs)
            if a is None:
                continue
            t = resolve(mods, a)
            if t is not None:
                targets.append(t)
                if segs[-1] == "*":  # and what that module's own globs bring
                    targets.extend(globbed(mods, t))
                elif tuple(a) in mods:
                    aliases[alias] = tuple(a)
        for p in PATH.findall(m.body):
            segs = p.split("::")
            a = absolute(mods, here, segs)
            if a is None and segs[0] in aliases:
                a = list(aliases[segs[0]]) + segs[1:]
            if a is not None:
                t = resolve(mods, a)
                if t is not None:
                    targets.append(t)
        for t in targets:
            if t != here:
                graph[here].add(t)
    return graph


def related(a, b):
    return a[: len(b)] == b or b[: len(a)] == a


def cycles(graph):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def name(p):
    return "::".join(p) or "crate"


def main():
    mods = load()
    graph = edges(mods)
    files = {p: {t for t in ts if not related(p, t)} for p, ts in graph.items()}
    print("# imports of each module (tests left out; mod.rs <-> its children not counted)")
    for p in sorted(files):
        if p:
            print(f"{name(p):32} -> {', '.join(sorted(name(t) for t in files[p])) or '-'}")
    domains = {}
    for p, ts in files.items():
        if p:
            domains.setdefault(p[:1], set()).update(t[:1] for t in ts if t and t[:1] != p[:1])
    print("\n# domains (top-level modules)")
    for d in sorted(domains):
        print(f"{name(d):32} -> {', '.join(sorted(name(t) for t in domains[d])) or '-'}")
    found = False
    for title, g in (("modules", files), ("domains", domains)):
        cs = cycles(g)
        print(f"\n# cycles among {title}: {len(cs)}")
        for c in cs:
            found = True
            print("  " + " <-> ".join(name(x) for x in c))
    sys.exit(1 if found else 0)


main()
