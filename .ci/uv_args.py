"""Print pip's configured package sources and constraints as uv arguments (uv reads neither pip.conf nor PIP_*).

The Makefile installs with uv where it can; on a machine whose pip points at a mirror, extra wheels or a
constraints file, uv must see the same sources and limits, and pick from all of them as pip does.
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

# pip option -> uv flag; both take one value per flag, several values separated by whitespace in pip's config
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def uv_args() -> list[str]:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    pairs: list[tuple[str, str]] = []
    for line in listed.stdout.splitlines():  # e.g. global.constraint='/etc/pip/constraints.txt', :env:.find-links='…'
        key, _, raw = line.partition("=")
        flag = FLAGS.get(key.rsplit(".", 1)[-1])
        if flag is not None and raw:
            pairs += [(flag, value) for value in str(ast.literal_eval(raw)).split()]
    args = ["--index-strategy", "unsafe-best-match"]  # pip merges every index and takes the best version
    for flag, value in dict.fromkeys(pairs):  # the same option set in a file and in the environment counts once
        args += [flag, value]
    return args


if __name__ == "__main__":
    print(shlex.join(uv_args()))
