"""A stand-in benchmark for the runner's tests: records when it started and writes one result set."""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks._common import SHARED_DATA, write_results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--value", type=float, default=1.0)
    args = parser.parse_args(argv)
    payload = {"started": time.time(), "quick": args.quick, "rows": [{"value": args.value}], "data": str(SHARED_DATA)}
    write_results("fake_benchmark_own_name", payload, *render(payload))


def render(payload: dict[str, Any]) -> tuple[str, None]:
    return f"value {payload['rows'][0]['value']}", None


if __name__ == "__main__":
    main()
