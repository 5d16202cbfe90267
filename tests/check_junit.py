"""Fail loudly when a pytest run executed no test (an empty or fully skipped suite is a defect)."""

import sys
import xml.etree.ElementTree as ET


def main(path: str) -> int:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    ran = tests - skipped
    print(f"junit: {tests} collected, {ran} ran, {skipped} skipped, {failed} failed")
    if ran <= 0:
        print("ERROR: no test ran", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
