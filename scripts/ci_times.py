"""Where a test run's time went: seconds per test directory (and the slowest files), read from
pytest's JUnit XML report. `.ci/run` prints it last, so a CI log's tail says what to speed up."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def times(report: Path) -> tuple[Counter[str], Counter[str]]:
    by_dir: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        seconds = float(case.get("time", "0") or 0)
        module = case.get("classname", "").split(".")
        path = "/".join(module[:-1]) + "/" + module[-1] + ".py" if len(module) > 1 else module[0]
        by_file[path] += seconds
        by_dir["/".join(module[:2]) if len(module) > 2 else module[0]] += seconds
    return by_dir, by_file


def main(paths: list[str]) -> None:
    for name in paths:
        report = Path(name)
        if not report.is_file():
            print(f"{name}: no report")
            continue
        by_dir, by_file = times(report)
        total = sum(by_dir.values())
        print(f"{report.name}: {total / 60:.1f} min in tests")
        for where, seconds in by_dir.most_common():
            print(f"  {seconds / 60:6.1f} min  {where}")
        print("  slowest files:")
        for where, seconds in by_file.most_common(12):
            print(f"  {seconds:6.0f} s    {where}")


if __name__ == "__main__":
    main(sys.argv[1:])
