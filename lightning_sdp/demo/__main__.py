"""``python -m lightning_sdp.demo``: the same as ``lightning-sdp demo``."""

import sys

from lightning_sdp.demo import main

sys.exit(main())
