"""Objects with many properties, compiled in near-linear time instead of quadratic.

xgrammar (0.2.9) writes an object's properties as a chain of rules: after property k, any later
one may come next (`B_part_k ::= B_part_{k+1} | ", " key_{k+1} ": " value_{k+1} B_part_{k+1}`;
a required one has only the second alternative). Its compile time grows with the chain's depth,
much faster than linearly: 1,000 optional properties took 7 s, 2,000 over a minute, 5,000
required ones 2.4 s. The same language (the properties in schema order, each optional one
present or not, each at most once, comma-separated) is written here as a balanced tree over the
property list: a segment's properties are its left half's, a comma, its right half's, or either
half alone where the other may be empty; a property, and a run of required ones, is written
inline rather than as a rule of its own. A given object has one parse. Measured (one core,
SmolLM2's vocabulary): 1,000 optional 0.3 s, 5,000 optional 4.5 s, 5,000 required 0.5 s.

Pure text over xgrammar's EBNF: an object is rewritten only when every rule of its chain has
exactly the shapes above (anything else, e.g. additional properties, is left as it was).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIN_PROPERTIES = 16  # smaller objects compile fast as they are
INLINE_RUN = 64  # required properties written in one sequence, at most

_RULE = re.compile(r"^([A-Za-z_][\w]*) ::= (.*)$")
_PART = re.compile(r"^(\w+)_part_(\d+)$")


@dataclass(frozen=True, slots=True)
class _Prop:
    key: str  # the quoted key literal, as xgrammar wrote it
    value: str  # the value's EBNF
    optional: bool


def _alternatives(body: str) -> list[str] | None:
    """The top-level alternatives of a rule body `((a) | (b) | "")`, each without its parens,
    or None if the body is not of that shape."""
    if not (body.startswith("(") and body.endswith(")")):
        return None
    inner = body[1:-1]
    alts, depth, start, i = [], 0, 0, 0
    while i < len(inner):
        c = inner[i]
        if c == '"':
            i += 1
            while inner[i] != '"':
                i += 2 if inner[i] == "\\" else 1
        elif c == "[":
            i += 1
            while inner[i] != "]":
                i += 2 if inner[i] == "\\" else 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            alts.append(inner[start:i].strip())
            start = i + 1
        i += 1
    alts.append(inner[start:].strip())
    out = []
    for a in alts:
        if a == '""':
            out.append("")
        elif a.startswith("(") and a.endswith(")"):
            out.append(a[1:-1])
        else:
            return None
    return out


_KEY = r'("\\"(?:[^"\\]|\\.)*\\"")'


_KEY_VALUE = re.compile(_KEY + r' ": " (.+)')


def _prop(alt: str, lead: str, rest: str | None) -> _Prop | None:
    """`lead KEY ": " VALUE [rest]` → the property (optional left False)."""
    tail = f" {rest}" if rest else ""
    if not (alt.startswith(lead) and alt.endswith(tail)):
        return None
    m = _KEY_VALUE.fullmatch(alt[len(lead) : len(alt) - len(tail)])
    return _Prop(m.group(1), m.group(2), False) if m else None


def _chain(base: str, rules: dict[str, str]) -> tuple[str, str | None, list[_Prop]] | None:
    """Object `base`'s start (see `_start`) and properties, or None if not as expected."""
    parts = 0
    while f"{base}_part_{parts}" in rules:
        parts += 1
    props: list[_Prop] = []
    for k in range(parts):
        alts = _alternatives(rules[f"{base}_part_{k}"])
        nxt = f"{base}_part_{k + 1}" if k + 1 < parts else None
        if alts is None:
            return None
        optional = len(alts) == 2 and alts[0] == (nxt or "")
        if not optional and len(alts) != 1:
            return None
        p = _prop(alts[-1], '", " ', nxt)
        if p is None:
            return None
        props.append(_Prop(p.key, p.value, optional))
    start = _start(base, rules)
    if start is None:
        return None
    name, replaced, first, first_optional, starts = start
    props.insert(0, _Prop(first.key, first.value, first_optional))
    # one way to start per property that can come first: up to the first required one
    required = [i for i, p in enumerate(props) if not p.optional]
    if starts != (required[0] + 1 if required else len(props)):
        return None
    return name, replaced, props


def _start(base: str, rules: dict[str, str]) -> tuple[str, str | None, _Prop, bool, int] | None:
    """Where object `base`'s properties start: (the rule, the text in it that is the first
    property and the chain (None: the rule is all that), the first property, whether it is
    optional, how many properties may come first). xgrammar gives an object whose first
    property is optional a rule of its own, one alternative per property that may come first,
    and writes a required first property inline where the object's braces are."""
    ref = f" {base}_part_0"
    for name, body in rules.items():
        if not name.startswith(base) or _PART.match(name) or ref not in body:
            continue
        alts = _alternatives(body)
        if alts and alts[0].endswith(ref) and alts[0].startswith('"\\"'):
            first = _prop(alts[0], "", f"{base}_part_0")
            return (name, None, first, len(alts) > 1, len(alts)) if first else None
        m = re.search(_KEY + r' ": " ([^()|]+?)' + re.escape(ref) + r"(?=[ )])", body)
        if m is not None and body.count(ref) == 1:
            return name, m.group(0), _Prop(m.group(1), m.group(2), False), False, 1
        return None
    return None


def _tree(name: str, props: list[_Prop]) -> list[str]:
    """Rules `name` and `name_s_L_R` (segments that need alternatives). A property and a run
    of required properties are written inline: xgrammar's compile time grows with the number
    of rules faster than with their length."""
    rules: list[str] = []

    def seg(lo: int, hi: int) -> tuple[str, bool, bool]:  # (expression, may be empty, inline)
        if lo == hi:
            p = props[lo]
            return f'{p.key} ": " {p.value}', p.optional, True
        mid = (lo + hi) // 2
        (left, left_empty, left_flat), (right, right_empty, right_flat) = (
            seg(lo, mid),
            seg(mid + 1, hi),
        )
        both = f'{left} ", " {right}'
        if not (left_empty or right_empty) and left_flat and right_flat and hi - lo < INLINE_RUN:
            return both, False, True
        alts = [both] + [left] * right_empty + [right] * left_empty
        rule = f"{name}_s_{lo}_{hi}"
        rules.append(f"{rule} ::= ({' | '.join(f'({a})' for a in alts)})")
        return rule, left_empty and right_empty, False

    top, _, _ = seg(0, len(props) - 1)
    rules.append(f"{name} ::= (({top}))")
    return rules


def balance_object_properties(ebnf: str) -> str:
    """`ebnf` with every object of at least MIN_PROPERTIES properties, some optional, written
    as a balanced tree (the same language)."""
    lines = ebnf.splitlines()
    rules: dict[str, str] = {}
    for line in lines:
        m = _RULE.match(line)
        if m:
            rules[m.group(1)] = m.group(2)
    bases = {m.group(1) for name in rules if (m := _PART.match(name)) and m.group(2) == "0"}
    drop: set[str] = set()
    edited: dict[str, str] = {}
    added: list[str] = []
    for base in sorted(bases):
        found = _chain(base, rules)
        if found is None:
            continue
        start, replaced, props = found
        if len(props) < MIN_PROPERTIES:
            continue
        drop.update(f"{base}_part_{k}" for k in range(len(props) - 1))
        if replaced is None:
            drop.add(start)
            added.extend(_tree(start, props))
        else:
            tree = f"{base}_props"
            edited[start] = edited.get(start, rules[start]).replace(replaced, tree, 1)
            added.extend(_tree(tree, props))
    if not drop:
        return ebnf
    out = []
    for line in lines:
        m = _RULE.match(line)
        if m and m.group(1) in drop:
            continue
        out.append(f"{m.group(1)} ::= {edited[m.group(1)]}" if m and m.group(1) in edited else line)
    return "\n".join(out + added) + "\n"
