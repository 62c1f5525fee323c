"""The small helpers of ``lightning_sdp.utilities``."""

from __future__ import annotations

import contextlib
import io
import logging
import sys


def _line_of(text: str, message: str) -> str:
    """What a terminal shows on the line that ends with ``message`` (carriage returns rewind the line)."""
    before = text[: text.index(message)].split("\n")[-1]
    return before.split("\r")[-1] + message


def test_rank_zero_say_gets_a_line_of_its_own_under_a_progress_bar():
    from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from lightning_sdp.utilities import rank_zero_say

    # one stream for stdout, stderr and the rank-zero log messages, as a terminal mixes them
    terminal = io.StringIO()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level = logging.StreamHandler(terminal), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(terminal), contextlib.redirect_stderr(terminal):
            bar = Tqdm(total=10, desc="Epoch 0", file=sys.stdout, ncols=60, mininterval=0)
            bar.update(3)
            rank_zero_info("plain message")
            rank_zero_say("said message")
            bar.update(2)
            bar.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    text = terminal.getvalue()
    assert "Epoch 0" in _line_of(text, "plain message")  # Lightning's own: at the end of the bar's line
    assert _line_of(text, "said message").strip() == "said message"  # the bar was cleared first
    assert text.count("Epoch 0") >= 4  # and drawn again after
