"""Rewrite ``tests/module_seconds.json`` from a ``make test`` junit file: each test module's
seconds (its tests' times summed). ``tests/conftest.py`` starts the longest modules first, so
the test processes finish together; refresh it when modules grow or move:
``python tests/module_seconds.py .venv/junit.xml``."""

import collections
import json
import os
import sys
import xml.etree.ElementTree as ET

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json")


def module_of(classname: str) -> str:
    """A junit classname without its test class (``tests.x.test_y.TestZ`` -> ``tests.x.test_y``)."""
    parts = classname.split(".")
    while parts and parts[-1][:1].isupper():
        parts.pop()
    return ".".join(parts)


def main(path: str) -> int:
    seconds: dict[str, float] = collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.get("classname"):
            seconds[module_of(case.get("classname"))] += float(case.get("time", 0))
    with open(OUT, "w") as f:
        json.dump({m: round(s, 1) for m, s in sorted(seconds.items())}, f, indent=0)
        f.write("\n")
    print(f"{OUT}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
