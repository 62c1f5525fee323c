"""WebDataset shards that are bad in the ways real ones are: every case raises naming the shard and the key, or, with
``on_error="skip"``, is dropped and counted when the shards are scanned (so training never meets it)."""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_sdp.datamodules.image_text import WebDatasetImageText, expand_shards
from lightning_sdp.datamodules.image_text.webdataset import MAX_SHARDS


def _image(value: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(value)  # noisy pixels: a compressed stream long enough to cut in half
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def _shard(path: Path, samples: list[tuple[str, str, bytes | None, bytes | None]]) -> Path:
    """A tar with ``<key>.<ext>`` image and ``<key>.txt`` caption members (``None``: member left out)."""
    with tarfile.open(path, "w") as tar:
        for key, ext, image, caption in samples:
            for name, data in ((f"{key}.{ext}", image), (f"{key}.txt", caption)):
                if data is None:
                    continue
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _good(i: int) -> tuple[str, str, bytes, bytes]:
    return f"{i:04d}", "png", _image(i), f"picture {i}".encode()


def _dataset(shards, on_error="raise") -> WebDatasetImageText:
    tokenizer = lambda texts: torch.tensor([[len(t)] for t in texts])  # noqa: E731
    transform = lambda img: torch.from_numpy(np.array(img)).float()  # noqa: E731
    return WebDatasetImageText(shards, transform, tokenizer, on_error=on_error)


BAD_CONTENTS = {
    "not an image": ("jpg", b"these bytes are not an image", b"a caption"),
    "truncated png": ("png", _image(7)[:300], b"a caption"),
    "truncated jpeg": ("jpg", _image(8, "JPEG")[:400], b"a caption"),  # passes verify(); only decoding finds it
    "non-utf8 caption": ("png", _image(9), b"caf\xe9 \xff\xfe"),
    "blank caption": ("png", _image(10), b"  \n"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTENTS))
def test_skip_mode_drops_and_counts_a_bad_sample_when_scanning(tmp_path, case):
    ext, image, caption = BAD_CONTENTS[case]
    shard = _shard(tmp_path / "s.tar", [_good(0), ("bad", ext, image, caption), _good(2)])
    with pytest.warns(UserWarning, match="Skipped 1 bad WebDataset sample"):
        ds = _dataset([shard], on_error="skip")
    assert ds.keys == ["0000", "0002"] and len(ds) == 2
    assert len(ds.skipped) == 1 and "s.tar sample 'bad'" in ds.skipped[0]
    assert [ds[i][2] for i in range(len(ds))] == [0, 1]  # every kept sample reads; indices stay contiguous
    assert ds.caption(1) == "picture 2"


@pytest.mark.parametrize(
    ("case", "error", "what"),
    [
        ("not an image", OSError, "Cannot decode the image"),
        ("truncated png", OSError, "Cannot decode the image"),
        ("truncated jpeg", OSError, "Cannot decode the image"),
        ("non-utf8 caption", ValueError, "not UTF-8"),
        ("blank caption", ValueError, "empty caption"),
    ],
)
def test_raise_mode_names_shard_and_key_when_a_bad_sample_is_read(tmp_path, case, error, what):
    ext, image, caption = BAD_CONTENTS[case]
    shard = _shard(tmp_path / "s.tar", [_good(0), ("bad", ext, image, caption)])
    ds = _dataset([shard])  # raise mode does not decode at construction
    assert len(ds) == 2 and ds[0][2] == 0
    with pytest.raises(error, match=rf"{what}.*") as err:
        ds[1]
    assert f"{shard} sample 'bad'" in str(err.value) and "on_error='skip'" in str(err.value)


def _truncated(tmp_path: Path, member: str) -> Path:
    """A shard of 3 good samples cut in the middle of ``member``'s data."""
    shard = _shard(tmp_path / "t.tar", [_good(0), _good(1), _good(2)])
    with tarfile.open(shard) as tar:
        last = tar.getmember(member)
    with open(shard, "r+b") as f:
        f.truncate(last.offset_data + last.size // 2)
    return shard


@pytest.mark.parametrize(
    ("member", "problem"),
    [
        ("0002.png", r"incomplete, the tar ends inside it \(truncated\)"),  # the caption's header is gone too
        ("0002.txt", r"data past the end of the file \(the tar is truncated\)"),  # both headers there, data cut
    ],
)
def test_a_truncated_tar_names_shard_and_key_or_keeps_what_is_complete(tmp_path, member, problem):
    shard = _truncated(tmp_path, member)
    with pytest.raises(ValueError, match=rf"t\.tar sample '0002': {problem}"):
        _dataset([shard])
    with pytest.warns(UserWarning, match="Skipped 2"):
        ds = _dataset([shard], on_error="skip")
    assert ds.keys == ["0000", "0001"]
    assert "sample '0002'" in ds.skipped[0] and "truncated or corrupt" in ds.skipped[1]
    assert "after sample '0002'" in ds.skipped[1] and ds[1][2] == 1


def test_garbage_in_the_middle_of_a_tar_is_not_dropped_silently(tmp_path):
    shard = _shard(tmp_path / "g.tar", [_good(0), _good(1), _good(2)])
    with tarfile.open(shard) as tar:
        second = tar.getmember("0001.png")
    data = bytearray(shard.read_bytes())
    data[second.offset : second.offset + 512] = b"\x07" * 512  # an invalid header block: tarfile stops quietly there
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"g\.tar: the tar has unreadable data from byte {second.offset} on"):
        _dataset([shard])
    with pytest.warns(UserWarning, match="Skipped 1"):
        ds = _dataset([shard], on_error="skip")
    assert ds.keys == ["0000"] and "after sample '0000'" in ds.skipped[0]


def test_a_shard_changed_after_the_scan_names_the_sample(tmp_path):
    shard = _shard(tmp_path / "c.tar", [_good(0), _good(1)])
    ds = _dataset([shard])
    with tarfile.open(shard) as tar:
        cut = tar.getmember("0001.png").offset_data + 10
    with open(shard, "r+b") as f:
        f.truncate(cut)
    with pytest.raises(OSError, match=r"c\.tar sample '0001': read 10 of \d+ bytes"):
        ds.load_image(1)


def test_a_huge_brace_range_is_refused_at_once_with_its_size(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"names 3,000,001 shards") as err:
        expand_shards(str(tmp_path / "shard-{0..3000000}.tar"))
    assert time.perf_counter() - t0 < 1.0 and f"{MAX_SHARDS:,}" in str(err.value)
    with pytest.raises(ValueError, match=r"names 200,000 shards"):  # ranges multiply, '::' parts add
        expand_shards(f"{tmp_path}/a-{{0..99}}-{{0..999}}.tar::{tmp_path}/b-{{0..99999}}.tar")
    with pytest.raises(ValueError, match=r"Bad range \{9..2\}"):
        expand_shards(str(tmp_path / "shard-{9..2}.tar"))
    with pytest.raises(ValueError, match=r"Bad range \{a..c\}"):
        expand_shards(str(tmp_path / "shard-{a..c}.tar"))
    _shard(tmp_path / "x-007.tar", [_good(0)])
    _shard(tmp_path / "x-008.tar", [_good(1)])
    assert [p.name for p in expand_shards(str(tmp_path / "x-{007..008}.tar"))] == ["x-007.tar", "x-008.tar"]


def test_a_decompression_bomb_names_shard_and_key_in_both_modes(tmp_path, monkeypatch):
    from PIL import Image

    shard = _shard(tmp_path / "b.tar", [_good(0), ("bomb", "png", _image(5), b"a caption")])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200)  # a 24 x 24 image is then more than twice the limit
    ds = _dataset([shard])
    with pytest.raises(OSError, match=r"Cannot decode the image of .*b\.tar sample '0000'.*decompression bomb"):
        ds[0]
    with pytest.warns(UserWarning, match="Skipped 2"):
        skipped = _dataset([shard], on_error="skip")
    assert "b.tar sample 'bomb'" in skipped.skipped[1] and "DecompressionBombError" in skipped.skipped[1]


def test_a_damaged_member_header_says_checksum_and_names_the_last_good_key(tmp_path):
    shard = _shard(tmp_path / "h.tar", [_good(0), _good(1), _good(2)])
    with tarfile.open(shard) as tar:
        second = tar.getmember("0001.png")
    data = bytearray(shard.read_bytes())
    data[second.offset] ^= 1  # one bit of the member's name: its header checksum no longer matches
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"h\.tar: .*byte {second.offset} on \(a damaged member header: bad checksum"):
        _dataset([shard])


def test_a_bomb_in_a_csv_image_names_the_file(tmp_path, monkeypatch):
    from PIL import Image

    from lightning_sdp.datamodules.image_text.datasets import FileImageText

    (tmp_path / "a.png").write_bytes(_image(3))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200)
    with pytest.raises(OSError, match=rf"cannot be read as images, first: {tmp_path / 'a.png'}"):
        FileImageText([tmp_path / "a.png"], ["a caption"], transform=lambda img: img, tokenizer=None)
