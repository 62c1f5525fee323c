"""Resuming SOLAR from a checkpoint continues the schedule exactly: no sample skipped or repeated, at any position."""

import h5py
import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sdp.datamodules.solar import SolarDataModule
from tests._distributed import run_distributed
from tests.datamodules._solar import solar_datamodule


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """32 samples of 4 floats whose value says the sample id (``x[i] == i``)."""
    path = tmp_path_factory.mktemp("solar_resume") / "tiny.h5"
    _write_tiny(path, 32)
    return str(path)


def _write_tiny(path, n):
    with h5py.File(path, "w") as f:
        f["x"] = np.repeat(np.arange(n, dtype=np.float32)[:, None], 4, axis=1)
        f["y"] = np.arange(n, dtype=np.float32)


class Tiny(LightningModule):
    """A linear model whose batches record the sample ids they hold (the input rows equal the ids)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch["input"], batch["target"]
        self.seen.append(x[:, 0].long().tolist())
        assert torch.equal(x[:, 0], y)  # inputs and targets of the same samples
        return batch["loss_scale"] * ((self.layer(x / 32).squeeze(1) - y / 32) ** 2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SaveAt(Callback):
    """Save a checkpoint after the given global steps, as ``ModelCheckpoint(every_n_train_steps=...)`` does."""

    def __init__(self, dirpath, steps):
        self.dirpath, self.steps = dirpath, set(steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            trainer.save_checkpoint(f"{self.dirpath}/step={trainer.global_step}.ckpt")


def _fit(path, max_epochs, ckpt_path=None, callbacks=(), devices=1, strategy="auto", **dm_kw):
    seed_everything(5)
    model = Tiny()
    args = dict(input_key="x", target_key="y", batch_size=4, batch_format="dict", log_metrics=False)
    args.update(dm_kw)
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    dm = solar_datamodule(path, **args)
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    _fit.buffer = dm.schedule.buffer_size  # the buffer's share of buffer_size (the read-ahead holds the rest)
    return model.seen, [p.detach().clone() for p in model.parameters()]


def test_checkpoint_on_an_epochs_last_batch_resumes_at_the_next_epoch(tiny, tmp_path):
    # 32 samples, batch 4: 8 steps per epoch; ModelCheckpoint on every epoch's last batch
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=8, save_top_k=-1, filename="{step}")
    full, _ = _fit(tiny, 3, callbacks=[saver])
    state = torch.load(tmp_path / "step=8.ckpt", weights_only=False)["SolarDataModule"]
    assert (state["position"]["epoch"], state["position"]["step"]) == (1, 0)
    rest, _ = _fit(tiny, 3, ckpt_path=str(tmp_path / "step=8.ckpt"))
    assert len(full) == 24
    assert rest == full[8:]  # epochs 1 and 2, none skipped


def test_mid_epoch_resume_without_workers_crosses_the_next_epoch_boundary(tiny, tmp_path):
    full, full_weights = _fit(tiny, 3, callbacks=[SaveAt(tmp_path, [11])], buffer_size=16)
    rest, weights = _fit(tiny, 3, ckpt_path=str(tmp_path / "step=11.ckpt"), buffer_size=16)
    assert rest == full[11:]
    for a, b in zip(full_weights, weights, strict=True):
        assert torch.equal(a, b)


def _linked_files(tmp_path, kind):
    """A file whose datasets are not rows at one offset of it: compressed, or behind an external link or a virtual
    dataset mapping another file."""
    if kind == "compressed":
        path = tmp_path / "compressed.h5"
        with h5py.File(path, "w") as f:
            x = np.repeat(np.arange(32, dtype=np.float32)[:, None], 4, axis=1)
            f.create_dataset("x", data=x, chunks=(5, 4), compression="gzip", shuffle=True)
            f.create_dataset("y", data=np.arange(32, dtype=np.float32), chunks=(5,), compression="gzip")
        return str(path)
    source = tmp_path / "source.h5"
    with h5py.File(source, "w") as f:
        f["pad"] = np.full(4096, -1.0, np.float32)  # the data start at another offset than in the linking file
        f["x"] = np.repeat(np.arange(32, dtype=np.float32)[:, None], 4, axis=1)
        f["y"] = np.arange(32, dtype=np.float32)
    linking = tmp_path / "linking.h5"
    with h5py.File(linking, "w") as f:
        f["other"] = np.full(16384, -2.0, np.float32)  # larger than the source: wrong offsets read without an error
        for key in ("x", "y"):
            if kind == "external_link":
                f[key] = h5py.ExternalLink(str(source), key)
            else:
                shape = (32, 4) if key == "x" else (32,)
                layout = h5py.VirtualLayout(shape=shape, dtype=np.float32)
                layout[:] = h5py.VirtualSource(str(source), key, shape=shape)
                f.create_virtual_dataset(key, layout)
    return str(linking)


@pytest.mark.parametrize("kind", ["external_link", "virtual", "compressed"])
def test_datasets_not_stored_as_rows_of_the_file_are_read_exactly(tmp_path, kind):
    path = _linked_files(tmp_path, kind)
    dm = SolarDataModule(path, input_key="x", target_key="y", batch_size=4, batch_format="dict", max_epochs=1)
    dm.setup("fit")
    seen = []
    for batch in dm.train_dataloader():
        ids = batch["index"]
        assert torch.equal(batch["input"][:, 0], ids.float()) and torch.equal(batch["target"], ids.float())
        seen += ids.tolist()
    assert sorted(seen) == list(range(32))


# The resume matrix: a checkpoint after the first, a middle and the last batch of epoch 1 (of 3), with 0 and 1 reader
# workers, no buffer and a buffer, on 1 and 2 processes. 30 samples, batch 4 per rank: the last global batch is short.
MATRIX_SAMPLES = 30
POSITIONS = ("first", "middle", "last")
CONFIGS = [(workers, buffer) for workers in (0, 1) for buffer in (0, 24)]


def _resume_matrix(rank, world_size, path, ckpt_dir):
    """Per ``(workers, buffer, position)``: this rank's batches after the checkpoint, uninterrupted and resumed."""
    torch.set_num_threads(1)
    if world_size > 1:
        # reader workers forked, as Linux starts them by default before Python 3.14 (the ranks here come from a fork
        # server, which would start each worker from a fresh interpreter); other start methods have their own test
        torch.multiprocessing.set_start_method("fork", force=True)
    ddp = dict(devices=world_size, strategy="ddp" if world_size > 1 else "auto")
    steps = -(-MATRIX_SAMPLES // (4 * world_size))
    at = {"first": steps + 1, "middle": steps + steps // 2, "last": 2 * steps}  # global steps, all in epoch 1
    out = {}
    for workers, buffer in CONFIGS:
        kw = dict(num_workers=workers, buffer_size=buffer, **ddp)
        folder = f"{ckpt_dir}/w{workers}b{buffer}"
        full, full_weights = _fit(path, 3, callbacks=[SaveAt(folder, at.values())], **kw)
        buffered = _fit.buffer
        for position, step in at.items():
            try:
                rest, weights = _fit(path, 3, ckpt_path=f"{folder}/step={step}.ckpt", **kw)
            except Exception as err:  # one case failing must not hide the others
                out[workers, buffer, position] = {"error": repr(err)}
                continue
            out[workers, buffer, position] = {
                "full": full[step:],
                "rest": rest,
                "weights_equal": all(torch.equal(a, b) for a, b in zip(full_weights, weights, strict=True)),
                "buffered": buffered,
            }
    return out


@pytest.fixture(scope="module")
def matrix_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("solar_matrix") / "tiny.h5"
    _write_tiny(path, MATRIX_SAMPLES)
    return str(path)


@pytest.fixture(scope="module")
def matrix(matrix_file, tmp_path_factory):
    """Each world size's whole matrix is run once (one process launch for the 2-process cases), lazily."""
    runs = {}

    def get(world_size):
        if world_size not in runs:
            ckpt = str(tmp_path_factory.mktemp(f"ckpt{world_size}"))
            try:
                if world_size == 1:
                    runs[1] = [_resume_matrix(0, 1, matrix_file, ckpt)]
                else:
                    runs[world_size] = run_distributed(
                        _resume_matrix, world_size, matrix_file, ckpt, init_group=False, timeout=240
                    )
            except Exception as err:  # reported by every case of this world size, without launching again
                runs[world_size] = err
        if isinstance(runs[world_size], Exception):
            raise runs[world_size]
        return runs[world_size]

    return get


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("workers,buffer", CONFIGS)
@pytest.mark.parametrize("position", POSITIONS)
def test_resume_at_any_position_continues_the_uninterrupted_run(matrix, world_size, workers, buffer, position):
    per_rank = [r[workers, buffer, position] for r in matrix(world_size)]
    for r in per_rank:
        assert "error" not in r, r.get("error")
        assert r["rest"] == r["full"]  # the same batches in the same order on this rank
        assert r["weights_equal"]
        assert (r["buffered"] > 0) == (buffer > 0)  # the plan kept a buffer beside the read-ahead
    # and so, over all ranks, every sample once in each remaining epoch
    steps = -(-MATRIX_SAMPLES // (4 * world_size))
    flat = [sum(step, []) for step in zip(*(r["rest"] for r in per_rank), strict=True)]
    done = {"first": 1, "middle": steps // 2, "last": steps}[position]
    epochs = [flat[: steps - done], flat[steps - done :]]
    assert sorted(sum(epochs[1], [])) == list(range(MATRIX_SAMPLES))
    assert len(set(sum(epochs[0], []))) == len(sum(epochs[0], []))


# Elastic resume: a checkpoint of 2 processes continues on 4, and one of 4 on 2, at the same sample of the epoch.
ELASTIC_SAMPLES = 100


def _elastic(rank, world_size, path, ckpt_dir, resume_from, save_at):
    """This rank's batches when resuming ``resume_from`` (if given), and of a full run saving after ``save_at``."""
    torch.set_num_threads(1)
    kw = dict(devices=world_size, strategy="ddp", buffer_size=24)
    out = {}
    if resume_from is not None:
        out["resumed"], _ = _fit(path, 3, ckpt_path=resume_from, **kw)
    if save_at is not None:
        out["full"], _ = _fit(path, 3, callbacks=[SaveAt(ckpt_dir, [save_at])], **kw)
    return out


def _global_steps(per_rank):
    """Each step's samples over all ranks (sorted), in step order."""
    return [sorted(sum(step, [])) for step in zip(*per_rank, strict=True)]


def _check_continues_at_the_same_sample(per_rank, world_size, sample):
    from lightning_sdp.datamodules.solar.schedule import SolarSchedule, epoch_steps

    order = SolarSchedule(ELASTIC_SAMPLES, 3, seed=0).permutation(1)  # epoch 1's global order, on any world size
    steps = _global_steps(per_rank)
    g = 4 * world_size
    rest = ELASTIC_SAMPLES - sample
    count = epoch_steps(rest, world_size, 4)
    for t, got in enumerate(steps[:count]):
        stop = ELASTIC_SAMPLES if t == count - 1 else sample + (t + 1) * g
        assert got == sorted(order[sample + t * g : stop].tolist())  # the schedule's order, from the same sample
    assert sorted(sum(steps[:count], [])) == sorted(order[sample:].tolist())  # the rest of epoch 1, once each
    assert sorted(sum(steps[count:], [])) == list(range(ELASTIC_SAMPLES))  # then epoch 2, whole
    assert len(steps) == count + epoch_steps(ELASTIC_SAMPLES, world_size, 4)


@pytest.mark.slow  # 2, 4 and 2 processes
def test_elastic_resume_two_to_four_and_four_to_two_processes(tmp_path):
    path = str(tmp_path / "ids.h5")
    _write_tiny(path, ELASTIC_SAMPLES)
    # 2 ranks x 4: 13 steps per epoch; saved after 5 steps of epoch 1 (global step 18): 40 samples of epoch 1 done
    run_distributed(_elastic, 2, path, str(tmp_path / "two"), None, 18, init_group=False)
    # 4 ranks x 4: 7 steps per epoch; 40 is no step boundary, so the other 60 samples make the epoch's last 4 steps.
    # The same launch saves its own checkpoint after 3 steps of epoch 1 (global step 10): 48 samples done
    four = run_distributed(
        _elastic, 4, path, str(tmp_path / "four"), str(tmp_path / "two/step=18.ckpt"), 10, init_group=False
    )
    _check_continues_at_the_same_sample([r["resumed"] for r in four], 4, sample=40)
    two = run_distributed(_elastic, 2, path, "", str(tmp_path / "four/step=10.ckpt"), None, init_group=False)
    _check_continues_at_the_same_sample([r["resumed"] for r in two], 2, sample=48)


def _sized(path, world_size, **kw):
    dm = SolarDataModule(path, input_key="x", target_key="y", batch_size=4, log_metrics=False, **kw)
    dm.rank, dm.world_size = 0, world_size  # as a Trainer of that many processes sets them in setup
    dm.setup("fit")
    return dm


def test_another_world_size_resumes_only_in_the_same_sample_order(tiny):
    state = _sized(tiny, 2, buffer_size=8, max_epochs=4).state_dict()
    four = _sized(tiny, 4, buffer_size=8, max_epochs=4)
    four.load_state_dict(state)
    assert four._pending_position["sample"] == 0
    # epoch_order="tsp" orders the epochs by the buffer, whose share of buffer_size the world size changes
    tsp = _sized(tiny, 2, buffer_size=24, max_epochs=4, epoch_order="tsp").state_dict()
    with pytest.raises(ValueError, match=r"visited the samples in another order .*world size 2 -> 4"):
        _sized(tiny, 4, buffer_size=24, max_epochs=4, epoch_order="tsp").load_state_dict(tsp)
    with pytest.raises(ValueError, match=r"seed: checkpoint 0 vs now 1"):
        _sized(tiny, 4, buffer_size=8, max_epochs=4, seed=1).load_state_dict(state)


@pytest.fixture(params=["spawn", "forkserver"])
def start_method(request):
    """Reader workers started by ``spawn`` or ``forkserver`` (Python 3.14's default on Linux)."""
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(request.param, force=True)
    yield request.param
    multiprocessing.set_start_method(before, force=True)


@pytest.mark.slow  # each worker starts a fresh interpreter that imports torch
def test_reader_workers_start_under_spawn_and_forkserver(tiny, start_method):
    batches = []
    for workers in (0, 1):
        kw = dict(batch_size=4, buffer_size=16, io_threads=2, batch_format="dict", max_epochs=2, log_metrics=False)
        dm = solar_datamodule(tiny, input_key="x", target_key="y", num_workers=workers, **kw)
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.reader.read(np.arange(4))  # the file (and its thread pool) open in this process: not sent along
        batches.append([b["index"].tolist() for _ in range(2) for b in loader])
        loader.close()
    assert batches[0] == batches[1] and len(batches[1]) == 16
