"""ImageTextDataModule and its datasets: built-in sets, OpenCLIP CSV convention, image folders, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_sdp.datamodules import sampling
from lightning_sdp.datamodules.image_text import (
    COLOURS,
    POSITIONS,
    SCENE_BACKGROUNDS,
    SHAPES,
    ImageTextDataModule,
    make_captioned_scenes,
    make_captioned_shapes,
    shape_classnames,
)

pytestmark = pytest.mark.open_clip


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on two shared cores OpenMP spin-waiting makes two threads several times slower."""
    torch.set_num_threads(1)


MICRO = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 8, "heads": 1, "layers": 1},
}


def test_captioned_shapes_are_deterministic_and_match_their_captions():
    imgs, caps, labels = make_captioned_shapes(60, seed=5)
    imgs2, caps2, _ = make_captioned_shapes(60, seed=5)
    assert np.array_equal(imgs, imgs2) and caps == caps2
    assert not np.array_equal(imgs, make_captioned_shapes(60, seed=6)[0])
    names = shape_classnames()
    assert len(names) == len(COLOURS) * len(SHAPES) == 40
    hits = 0
    for img, cap, y in zip(imgs, caps, labels, strict=True):
        colour, shape = names[y].split()
        assert f" {colour} {shape} " in f" {cap} "
        # the pixels closest to the named colour sit in the named part of the image
        dist = np.abs(img.astype(float) - np.array(COLOURS[colour])).sum(-1)
        ys, xs = np.nonzero(dist < 60)
        if len(ys) == 0:
            continue
        cy, cx = ys.mean() / 32, xs.mean() / 32
        pos = next(p for p in POSITIONS if cap.endswith(p))
        py, px = POSITIONS[pos]
        hits += abs(cy - py) < 0.15 and abs(cx - px) < 0.15
    assert hits >= 50


def test_captioned_scenes_are_deterministic_and_their_labels_match_their_captions():
    imgs, caps, labels = make_captioned_scenes(80, seed=2, image_size=24)
    imgs2, caps2, labels2 = make_captioned_scenes(80, seed=2, image_size=24)
    assert imgs.shape == (80, 24, 24, 3) and np.array_equal(imgs, imgs2) and caps == caps2
    assert np.array_equal(labels, labels2)
    names = shape_classnames()
    for cap, y in zip(caps, labels, strict=True):
        colour, shape = names[y].split()
        assert f" {colour} {shape} " in cap and any(cap.endswith(f"on a {bg} background") for bg in SCENE_BACKGROUNDS)
    assert len(set(caps)) > 70  # 12,960 possible captions: few repeat
    # the shared drawing routine: shapes and scenes of one seed differ (different attributes and backgrounds)
    assert not np.array_equal(imgs, make_captioned_shapes(80, seed=2, image_size=24)[0])


def test_image_text_package_imports_no_higher_layer():
    """The data layer imports neither models, callbacks nor plugins (the open_clip adapter lives in integrations)."""
    import ast
    from pathlib import Path

    import lightning_sdp.datamodules.image_text as package
    import lightning_sdp.integrations.open_clip as adapter

    files = [*Path(package.__file__).parent.glob("*.py"), Path(adapter.__file__)]
    assert len(files) >= 7
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(tuple(f"lightning_sdp.{p}" for p in ("models", "callbacks", "plugins"))), (
                    f"{path.name} imports {name}"
                )


def test_shapes_datamodule_samples_and_loaders():
    dm = ImageTextDataModule(model=MICRO, num_train=40, num_val=12, batch_size=8, augment=False)
    assert dm.data_size == 40
    image, tokens, index = dm.train_set[7]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert tokens.shape == (12,) and tokens.dtype == torch.long and index == 7
    assert dm.classnames == shape_classnames() and "{}" in dm.templates[0]
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == 5 and all(b[0].shape[0] == 8 for b in batches)
    seen = torch.cat([b[2] for b in batches])
    assert sorted(seen.tolist()) == list(range(40))  # one epoch visits every index once
    # the order depends only on (seed, epoch): a fresh loader repeats it, a new epoch changes it
    assert torch.equal(torch.cat([b[2] for b in dm.train_dataloader()]), seen)
    sampler = loader.sampler
    # the shared epoch-seeded sampler: the order is NumPy's permutation for [seed, epoch]
    assert isinstance(sampler, sampling.EpochSeededSampler)
    assert seen.tolist() == sampling.epoch_permutation(40, seed=0, epoch=0).tolist()
    sampler.set_epoch(1)
    assert list(sampler) != seen.tolist()
    assert list(sampler) == sampling.epoch_permutation(40, seed=0, epoch=1).tolist()
    val = next(iter(dm.val_dataloader()))
    assert len(val) == 3 and val[0].shape[0] == 8
    with pytest.raises(ValueError, match="batch_size=64"):
        ImageTextDataModule(model=MICRO, num_train=40, batch_size=64).train_dataloader()


def test_train_loader_drop_last_is_an_argument_defaulting_to_true():
    # 25 pairs in batches of 8: the last batch would hold one pair
    dm = ImageTextDataModule(model=MICRO, num_train=25, num_val=8, batch_size=8, augment=False)
    assert dm.hparams.drop_last is True
    assert [len(b[2]) for b in dm.train_dataloader()] == [8, 8, 8]
    kept = ImageTextDataModule(model=MICRO, num_train=25, num_val=8, batch_size=8, augment=False, drop_last=False)
    assert [len(b[2]) for b in kept.train_dataloader()] == [8, 8, 8, 1]
    # without dropping, a batch larger than the set is allowed (one short batch)
    small = ImageTextDataModule(model=MICRO, num_train=6, num_val=4, batch_size=8, augment=False, drop_last=False)
    assert [len(b[2]) for b in small.train_dataloader()] == [6]
    with pytest.raises(ValueError, match="drop_last=False"):
        ImageTextDataModule(model=MICRO, num_train=6, num_val=4, batch_size=8).train_dataloader()


@pytest.mark.parametrize("drop_last", [True, False])
def test_global_batches_do_not_depend_on_the_number_of_processes(drop_last):
    """On K processes with batch b each, the ranks' batches (in rank order) are the one-process batches of K * b."""
    from types import SimpleNamespace

    n, world, b = 27, 3, 2
    one = ImageTextDataModule(
        model=MICRO, num_train=n, num_val=4, batch_size=world * b, augment=False, drop_last=drop_last
    )
    one.trainer = SimpleNamespace(global_rank=0, world_size=1)
    loaders = []
    for rank in range(world):
        dm = ImageTextDataModule(model=MICRO, num_train=n, num_val=4, batch_size=b, augment=False, drop_last=drop_last)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=world)  # what Lightning attaches
        loader = dm.train_dataloader()
        assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)  # so Lightning keeps it
        loader.sampler.set_epoch(1)
        loaders.append(loader)
    one_loader = one.train_dataloader()
    one_loader.sampler.set_epoch(1)
    expected = [batch[2].tolist() for batch in one_loader]
    per_rank = [[batch[2].tolist() for batch in loader] for loader in loaders]
    assert len({len(r) for r in per_rank}) == 1  # every rank runs the same number of steps
    together = [sum(parts, []) for parts in zip(*per_rank, strict=True)]
    if drop_last:
        assert together == expected  # 4 global batches of 6
    else:  # 27 = 4 x 6 + 3: the remainder is split evenly, one pair per rank
        assert together[:-1] == expected[:-1] and together[-1] == expected[-1][:3]


@pytest.mark.sklearn
def test_digits_set_has_prompt_captions():
    dm = ImageTextDataModule(dataset="digits", model=MICRO, val_fraction=0.2)
    dm.setup()
    assert dm.data_size + len(dm.val_set) == 1797
    assert dm.classnames[3] == "three"
    for i in range(0, 200, 37):
        assert dm.classnames[int(dm.train_set.labels[i])] in dm.train_set.captions[i]


def _write_images(folder, n, size=20):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        arr = np.full((size, size, 3), 20 * i, dtype=np.uint8)
        name = f"img_{i}.png"
        Image.fromarray(arr).save(folder / name)
        names.append(name)
    return names


def test_csv_convention_with_custom_columns_and_separator(tmp_path):
    names = _write_images(tmp_path / "images", 6)
    csv_path = tmp_path / "pairs.csv"
    csv_path.write_text("path,caption\n" + "".join(f"images/{n},picture number {i}\n" for i, n in enumerate(names)))
    dm = ImageTextDataModule(
        dataset="csv",
        train_data=str(csv_path),
        model=MICRO,
        csv_img_key="path",
        csv_caption_key="caption",
        csv_separator=",",
        val_fraction=0.34,
        batch_size=2,
    )
    dm.setup()
    assert dm.data_size == 4 and len(dm.val_set) == 2
    image, tokens, index = dm.train_set[1]
    assert image.shape == (3, 16, 16) and index == 1
    assert dm.classnames is None  # retrieval only
    # OpenCLIP's default: tab separator, filepath/title columns; a wrong column names the columns
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("filepath\ttitle\n" + "".join(f"images/{n}\tpicture {i}\n" for i, n in enumerate(names)))
    assert ImageTextDataModule(dataset="csv", train_data=str(tsv), model=MICRO).data_size == 5
    with pytest.raises(KeyError, match="columns"):
        ImageTextDataModule(dataset="csv", train_data=str(tsv), model=MICRO, csv_caption_key="text").setup()


def test_missing_and_unreadable_images_raise_or_are_skipped_and_counted(tmp_path):
    names = _write_images(tmp_path, 5)
    (tmp_path / "broken.png").write_bytes(b"not an image")
    lines = [f"{n}\tcaption {i}" for i, n in enumerate(names)] + ["missing.png\tgone", "broken.png\tbad"]
    (tmp_path / "captions.tsv").write_text("\n".join(lines) + "\n")
    with pytest.raises(FileNotFoundError, match="missing.png"):
        ImageTextDataModule(dataset="folder", train_data=str(tmp_path), val_data=str(tmp_path), model=MICRO).setup()
    with pytest.warns(UserWarning, match="Skipped 2"):
        dm = ImageTextDataModule(
            dataset="folder", train_data=str(tmp_path), val_data=str(tmp_path), model=MICRO, on_error="skip"
        )
        dm.setup()
    assert dm.data_size == 5 and len(dm.train_set.skipped) == 2
    # raise mode: an unreadable file stops setup (before any training step), naming the file
    (tmp_path / "captions.tsv").write_text("\n".join(lines[:5] + [lines[6]]) + "\n")
    dm = ImageTextDataModule(dataset="folder", train_data=str(tmp_path), val_data=str(tmp_path), model=MICRO)
    with pytest.raises(OSError, match="1 image file.*broken.png"):
        dm.setup()


def test_corrupt_image_fails_at_setup_not_during_training(tmp_path):
    """A file whose bytes are not an image (here the 4th of 8) is found by setup's header check."""
    names = _write_images(tmp_path, 8)
    (tmp_path / names[3]).write_bytes(b"\x89PNG garbage" + bytes(range(200)))
    (tmp_path / "captions.tsv").write_text("".join(f"{n}\tpicture {i}\n" for i, n in enumerate(names)))
    dm = ImageTextDataModule(dataset="folder", train_data=str(tmp_path), val_data=str(tmp_path), model=MICRO)
    with pytest.raises(OSError, match=names[3]):
        dm.setup()


def test_empty_captions_and_short_csv_rows_get_clear_errors(tmp_path):
    names = _write_images(tmp_path / "images", 4)
    csv_path = tmp_path / "pairs.tsv"
    rows = [f"images/{n}\tpicture {i}" for i, n in enumerate(names)]
    csv_path.write_text("filepath\ttitle\n" + "\n".join(rows[:2] + [f"images/{names[2]}\t  "] + rows[3:]) + "\n")
    with pytest.raises(ValueError, match="empty caption.*img_2.png"):
        ImageTextDataModule(dataset="csv", train_data=str(csv_path), val_data=str(csv_path), model=MICRO).setup()
    with pytest.warns(UserWarning, match="empty caption"):
        dm = ImageTextDataModule(
            dataset="csv", train_data=str(csv_path), val_data=str(csv_path), model=MICRO, on_error="skip"
        )
        dm.setup()
    assert dm.data_size == 3
    # a row without a caption column (fewer fields than the header) names the file and line
    csv_path.write_text("filepath\ttitle\n" + "\n".join(rows[:3] + [f"images/{names[3]}"]) + "\n")
    with pytest.raises(ValueError, match=r"pairs.tsv:5: the row has no 'title' value"):
        ImageTextDataModule(dataset="csv", train_data=str(csv_path), model=MICRO).setup()


def test_bad_arguments():
    with pytest.raises(ValueError, match="train_data"):
        ImageTextDataModule(dataset="csv")
    with pytest.raises(ValueError, match="dataset must be"):
        ImageTextDataModule(dataset="laion")
    with pytest.raises(FileNotFoundError, match="nowhere.tsv"):
        ImageTextDataModule(dataset="csv", train_data="nowhere.tsv", model=MICRO).setup()


def _write_shards(folder, n_shards, per_shard, size=20, broken=None):
    """OpenCLIP-style shards: <key>.png + <key>.txt per sample (``broken``: a key whose .txt is left out)."""
    import io
    import tarfile

    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    k = 0
    for s in range(n_shards):
        with tarfile.open(folder / f"shard-{s:03d}.tar", "w") as tar:
            for _ in range(per_shard):
                key = f"{k:06d}"
                buf = io.BytesIO()
                Image.fromarray(np.full((size, size, 3), 10 * k % 255, dtype=np.uint8)).save(buf, format="PNG")
                files = {f"{key}.png": buf.getvalue()}
                if key != broken:
                    files[f"{key}.txt"] = f"picture number {k}".encode()
                for name, data in files.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                k += 1


def test_webdataset_shards_are_picked_from_the_path_and_keep_sample_indices(tmp_path):
    from lightning_sdp.datamodules.image_text import WebDatasetImageText, expand_shards

    _write_shards(tmp_path / "train", 3, 4)
    _write_shards(tmp_path / "val", 1, 3)
    pattern = str(tmp_path / "train" / "shard-{000..002}.tar")
    assert [p.name for p in expand_shards(pattern)] == ["shard-000.tar", "shard-001.tar", "shard-002.tar"]
    dm = ImageTextDataModule(
        train_data=pattern, val_data=str(tmp_path / "val" / "shard-000.tar"), model=MICRO, batch_size=4, augment=False
    )
    assert dm.kind == "webdataset"
    dm.setup()
    assert isinstance(dm.train_set, WebDatasetImageText) and dm.data_size == 12 and len(dm.val_set) == 3
    image, tokens, index = dm.train_set[6]
    assert image.shape == (3, 16, 16) and index == 6 and dm.train_set.keys[6] == "000006"
    assert dm.train_set.caption(6) == "picture number 6"
    seen = sorted(int(i) for batch in dm.train_dataloader() for i in batch[2])
    assert seen == list(range(12))  # every index once per epoch: the estimators' addresses
    # no val_data: a held-out split with renumbered indices
    dm = ImageTextDataModule(dataset="csv", train_data=pattern, model=MICRO, val_fraction=0.25, batch_size=3)
    dm.setup()
    assert dm.kind == "webdataset" and dm.data_size == 9 and len(dm.val_set) == 3 and dm.train_set[8][2] == 8


def test_webdataset_bad_shards_get_clear_errors(tmp_path):
    from lightning_sdp.datamodules.image_text import expand_shards

    _write_shards(tmp_path, 1, 4, broken="000002")
    shard = str(tmp_path / "shard-000.tar")
    with pytest.raises(ValueError, match="000002.*no caption"):
        ImageTextDataModule(train_data=shard, val_data=shard, model=MICRO).setup()
    with pytest.warns(UserWarning, match="Skipped 1"):
        dm = ImageTextDataModule(train_data=shard, val_data=shard, model=MICRO, on_error="skip", batch_size=2)
        dm.setup()
    assert dm.data_size == 3
    with pytest.raises(FileNotFoundError, match="shard-001.tar"):
        expand_shards(str(tmp_path / "shard-{000..001}.tar"))
    with pytest.raises(ValueError, match="remote URL"):
        expand_shards("s3://bucket/shard-{000..001}.tar")
