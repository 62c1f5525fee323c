from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from lightning_sdp.datamodules.text import CharTextDataModule
from lightning_sdp.models.gpt import GPT, _causal_linear_attention
from lightning_sdp.schedules import WarmupCosine


def _tiny(**kw) -> GPT:
    args = dict(vocab_size=17, n_layer=2, n_head=2, n_embd=16, block_size=12)
    args.update(kw)
    return GPT(**args)


def test_forward_shape_and_weight_tying():
    model = _tiny()
    logits = model(torch.randint(0, 17, (3, 12)))
    assert logits.shape == (3, 12, 17)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("other", ["explicit"])
def test_explicit_attention_equals_sdpa(other):
    torch.manual_seed(1)
    fused = _tiny(attention="sdpa")
    explicit = _tiny(attention=other)
    explicit.load_state_dict(fused.state_dict())
    idx = torch.randint(0, 17, (4, 9))
    torch.testing.assert_close(explicit(idx), fused(idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("T", "chunk"), [(7, 64), (7, 3), (12, 4), (1, 2)])
def test_linear_attention_matches_quadratic_reference(T, chunk):
    q, k, v = (torch.randn(2, 3, T, 4, dtype=torch.float64) for _ in range(3))
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    scores = (fq @ fk.transpose(-2, -1)).tril()  # causal, unnormalised kernel weights
    ref = (scores @ v) / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(_causal_linear_attention(q, k, v, eps=0.0, chunk=chunk), ref)


def test_attention_is_causal():
    model = _tiny(attention="explicit").eval()
    idx = torch.randint(0, 17, (1, 10))
    changed = idx.clone()
    changed[0, 7] = (idx[0, 7] + 1) % 17
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="divisible"):
        GPT(vocab_size=5, n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="attention"):
        GPT(vocab_size=5, attention="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exceeds block_size"):
        _tiny()(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(RuntimeError, match="vocab_size"):
        GPT()(torch.zeros(1, 3, dtype=torch.long))


def test_cosine_schedule_shape():
    s = WarmupCosine(warmup=10, total=110, min_ratio=0.1)
    # warm-up (step + 1) / warmup: the last warm-up step reaches 1 (it was (step + 1) / (warmup + 1) before issue 18)
    assert math.isclose(s(0), 0.1) and s(0) < s(5) < s(9)
    assert math.isclose(s(9), 1.0) and math.isclose(s(10), 1.0)
    assert math.isclose(s(60), 0.55)
    assert math.isclose(s(110), 0.1) and math.isclose(s(500), 0.1)


def test_schedule_is_the_shared_warmup_cosine_and_its_checkpoint_state_loads():
    conf = GPT(vocab_size=5, n_layer=1, n_head=2, n_embd=16, block_size=8, warmup_steps=4, max_steps=20)
    conf = conf.configure_optimizers()
    scheduler = conf["lr_scheduler"]["scheduler"]
    assert isinstance(scheduler.lr_lambdas[0], WarmupCosine)
    assert math.isclose(conf["optimizer"].param_groups[0]["lr"], 1e-3 / 4)  # step 0: 1 / warmup of the peak
    # a checkpoint holds the schedule's attributes (the old _CosineWithWarmup had the same ones), not its class
    state = scheduler.state_dict()
    assert state["lr_lambdas"] == [{"warmup": 4, "total": 20, "min_ratio": 0.1}] * 2  # one per parameter group
    other = GPT(vocab_size=5, n_layer=1, n_head=2, n_embd=16, block_size=8, warmup_steps=1, max_steps=5)
    other_scheduler = other.configure_optimizers()["lr_scheduler"]["scheduler"]
    other_scheduler.load_state_dict(state)
    assert (other_scheduler.lr_lambdas[0].warmup, other_scheduler.lr_lambdas[0].total) == (4, 20)


def test_optimizer_groups_decay_only_matrices():
    model = _tiny()
    opt = model.configure_optimizers()["optimizer"]
    decay, no_decay = opt.param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_parameters()


def _trainer(tmp_path, steps: int) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=2,
        val_check_interval=steps,
        check_val_every_n_epoch=None,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=tmp_path,
    )


def test_fit_takes_vocab_from_datamodule_and_learns(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abcabcabd " * 400)
    data = CharTextDataModule(str(text), block_size=8, batch_size=8)
    model = GPT(n_layer=1, n_head=2, n_embd=32, block_size=8, learning_rate=3e-3, warmup_steps=5)
    trainer = _trainer(tmp_path, 60)
    trainer.fit(model, datamodule=data)
    assert model.hparams.vocab_size == 5
    assert float(trainer.callback_metrics["val/loss"]) < 0.8 * math.log(5)
    ckpt = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt)
    restored = GPT.load_from_checkpoint(ckpt, weights_only=False)
    idx = torch.randint(0, 5, (2, 8))
    torch.testing.assert_close(restored(idx), model(idx))


def test_vocab_none_without_datamodule_says_what_to_do(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)))
    with pytest.raises(ValueError, match="Pass vocab_size"):
        _trainer(tmp_path, 1).fit(GPT(block_size=8), loader)
