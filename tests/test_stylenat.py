"""StyleNAT: generator / discriminator, GAN training pieces, sampling, FID and checkpoint mapping.

Models here are tiny (32x32, 16-32 channels) so the whole file runs in a few minutes on 2 CPU
cores with the naive NA backend; the published-size checks build the models on the meta device.
"""
from __future__ import annotations

import math
import os

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ops
from namodels.data.images import GANDataModule, ImageFolder, SkimageCrops
from namodels.models.stylegan2 import HaarTransform, InverseHaarTransform, MinibatchStdDev, upfirdn2d
from namodels.models.stylenat import (
    HydraNeighborhoodAttention,
    StyleNATDiscriminator,
    StyleNATGenerator,
    convert_official_generator,
    default_windows,
    load_official_generator,
    sinusoidal_grid,
)
from namodels.tasks.fid import INCEPTION_WEIGHTS_FILE, compute_fid, inception_weights_path
from namodels.tasks.gan import (
    GANTask,
    d_logistic_loss,
    diff_augment,
    ema_decay,
    g_nonsaturating_loss,
    lazy_regularization_hparams,
    load_generator,
    r1_penalty,
)
from namodels.tasks.generate import generate_images, images_per_second
from tests.oracle import oracle_attention

TINY_G = dict(size=32, channels=[32, 32, 16, 16], style_dim=16, n_mlp=2)
TINY_D = dict(size=32, channels=[32, 32, 16, 16])


@pytest.fixture(autouse=True)
def _naive_backend():
    with ops.use_backend("naive"):
        yield


def tiny_generator(seed=0, **kw):
    torch.manual_seed(seed)
    return StyleNATGenerator(**{**TINY_G, **kw})


def randomize(module: nn.Module, seed: int = 1):
    """Fresh non-zero values everywhere (zero-initialised alphas / biases would hide mapping errors)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + p)
    return module


# ------------------------------------------------------------------------------------------------
# Generator
# ------------------------------------------------------------------------------------------------


def test_published_parameter_counts():
    """FFHQ-256 and FFHQ-1024 generators have the published 48.92M / 49.45M parameters."""
    counts = {}
    for size in (256, 1024):
        with torch.device("meta"):
            g = StyleNATGenerator(size)
        counts[size] = sum(p.numel() for p in g.parameters())
    # The release adds a second 3-vector bias per ToRGB (folded into the conv bias here): 7 / 9 of them.
    assert counts[256] + 3 * 7 == 48_921_000
    assert round(counts[256] / 1e6, 2) == 48.92
    assert round(counts[1024] / 1e6, 2) == 49.45


# (state_dict entries, sha256 of "key:shape" lines in order)[:16] of the layouts checkpoints hold
STATE_DICT_LAYOUTS = {
    "g256": (250, "f0cfbef14027359f"), "d256": (77, "6d5e7d54d4dfd77d"), "g1024": (318, "2124e1f7797fcbef"),
    "g_tiny": (140, "b76d5a7ab93959c1"), "d_tiny": (41, "9893f3ef5175b253"), "d64_no_sn": (26, "92ce94c491011a1d"),
}


def _layout(module):
    import hashlib

    state = module.state_dict()
    text = "\n".join(f"{k}:{tuple(v.shape)}" for k, v in state.items())
    return len(state), hashlib.sha256(text.encode()).hexdigest()[:16]


def test_state_dict_layouts_are_unchanged():
    """Checkpoint keys, shapes and order of the generator and discriminator (released FFHQ sizes, the
    built-in tiny model, the equalized-lr discriminator) stay those of the files already written."""
    tiny = dict(channel_multiplier=1, channels=[64, 64, 64, 32])
    with torch.device("meta"):
        built = {
            "g256": StyleNATGenerator(256), "d256": StyleNATDiscriminator(256), "g1024": StyleNATGenerator(1024),
            "g_tiny": StyleNATGenerator(32, style_dim=64, n_mlp=4, **tiny), "d_tiny": StyleNATDiscriminator(32, **tiny),
            "d64_no_sn": StyleNATDiscriminator(64, sn=False),
        }
    assert {name: _layout(m) for name, m in built.items()} == STATE_DICT_LAYOUTS


def test_stylegan2_blocks_are_shared_not_copied():
    import namodels.models.stylegan2 as blocks
    import namodels.models.stylenat as stylenat

    for name in ("StyleNATDiscriminator", "MappingNetwork", "upfirdn2d", "stage_channels"):
        assert getattr(stylenat, name) is getattr(blocks, name), name
    g = StyleNATGenerator(**TINY_G)
    assert isinstance(g.mapping, blocks.MappingNetwork) and isinstance(g.to_rgbs[0], blocks.ToRGB)
    assert type(g.stages[0].blocks[0].attn) is HydraNeighborhoodAttention


def test_default_windows_follow_ffhq256_release():
    # kernel 7; dilations [1] (two groups) at 8, [1, r/8] above; 4x4: one full-attention group.
    assert default_windows(4) == [(4, 1)]
    assert default_windows(8) == [(7, 1), (7, 1)]
    assert [default_windows(r)[1][1] for r in (16, 32, 64, 128, 256, 512, 1024)] == [2, 4, 8, 16, 32, 64, 128]
    for r in (8, 16, 32, 64, 128, 256, 1024):
        assert all(k * d <= r for k, d in default_windows(r))
    # Clamped when r/8 * K would not fit (small kernel-to-map ratios): K=11 at 64 -> 64 // 11 = 5.
    assert default_windows(64, kernel_size=11) == [(11, 1), (11, 5)]


@pytest.mark.parametrize("size", [32, 64])
def test_generator_shapes_and_heads(size):
    chans = [16] * (int(math.log2(size)) - 1)
    g = tiny_generator(size=size, channels=chans)
    z = torch.randn(2, 16)
    with torch.no_grad():
        img, ws = g(z, return_latents=True)
    assert img.shape == (2, 3, size, size) and torch.isfinite(img).all()
    assert ws.shape == (2, g.n_latent, 16) and g.n_latent == 2 * len(g.resolutions)
    attn = g.stages[-1].blocks[0].attn
    assert attn.num_heads == 4 and len(attn.rpb) == 2  # max(16 // 32, min_heads=4) heads, two groups
    assert [tuple(p.shape) for p in attn.rpb] == [(2, 13, 13), (2, 13, 13)]
    assert g.stages[0].blocks[0].attn.windows == [(4, 1)]


def test_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="size"):
        StyleNATGenerator(48)
    with pytest.raises(ValueError, match="windows"):
        StyleNATGenerator(**TINY_G, windows=[None, [[7, 2]], None, None])  # 7 * 2 > 8
    with pytest.raises(ValueError, match="channels"):
        StyleNATGenerator(size=32, channels=[16, 16])
    g = tiny_generator()
    with pytest.raises(ValueError, match="z"):
        g(torch.randn(2, 17))


def test_hydra_attention_matches_per_group_oracle():
    """Each head group attends with its own kernel / dilation / RPB (float64 dense oracle)."""
    torch.manual_seed(3)
    attn = HydraNeighborhoodAttention(24, 6, [(3, 1), (5, 2), (3, 3)]).double()
    randomize(attn, 4)
    x = torch.randn(2, 11, 10, 24, dtype=torch.float64)
    out = attn(x)
    q, k, v = attn.qkv(x).view(2, 11, 10, 3, 6, 4).unbind(3)
    parts = []
    for (lo, hi), (kernel, dil), rpb in zip(attn.head_slices, attn.windows, attn.rpb):
        o, _ = oracle_attention(q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :], (11, 10), (kernel,) * 2,
                                (1, 1), (dil,) * 2, (False, False), rpb=rpb)
        parts.append(o)
    ref = attn.proj(torch.cat(parts, dim=-2).reshape(2, 11, 10, 24))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    # Uneven split: the remainder goes to the last groups (release rule).
    assert HydraNeighborhoodAttention(28, 7, [(3, 1), (3, 1), (3, 1)]).head_slices == [(0, 2), (2, 4), (4, 7)]


def test_full_attention_stage_matches_release_mhsa_rpb():
    """The 4x4 stage (NA with kernel 4 on a 4x4 map) equals the release's MHSARPB: dense attention
    with a bias table indexed through its flipped relative-position index."""
    torch.manual_seed(5)
    heads, K = 4, 4
    attn = HydraNeighborhoodAttention(32, heads, [(K, 1)]).double()
    randomize(attn, 6)
    x = torch.randn(3, K, K, 32, dtype=torch.float64)
    coords = torch.stack(torch.meshgrid(torch.arange(K), torch.arange(K), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (K - 1)
    index = torch.flipud(torch.fliplr(rel[..., 0] * (2 * K - 1) + rel[..., 1]))  # [16, 16]
    table = attn.rpb[0].permute(1, 2, 0).flatten(0, 1)  # [(2K-1)^2, heads]
    bias = table[index.reshape(-1)].view(K * K, K * K, heads).permute(2, 0, 1)
    q, k, v = attn.qkv(x).reshape(3, K * K, 3, heads, 8).permute(2, 0, 3, 1, 4)
    logits = (q * 8**-0.5) @ k.transpose(-2, -1) + bias
    ref = (logits.softmax(-1) @ v).transpose(1, 2).reshape(3, K, K, 32)
    torch.testing.assert_close(attn(x), attn.proj(ref), rtol=1e-9, atol=1e-9)


def test_mapping_truncation_and_style_mixing():
    g = tiny_generator().eval()
    z = torch.randn(3, 16) * 3
    w = g.map(z)
    assert w.shape == (3, 16)
    # Pixel norm: the scale of z does not matter.
    torch.testing.assert_close(g.map(z * 7.0), w, rtol=1e-5, atol=1e-5)
    # Equalized lr with lr multiplier 0.01: stored weights are N(0, 1) / 0.01, used at 0.01 / sqrt(fan_in).
    layer = g.mapping.layers[0]
    assert abs(layer.weight.std().item() * 0.01 - 1) < 0.35 and layer.scale == pytest.approx(0.01 / 4)
    # w_avg tracks the mean of w in training mode only.
    assert torch.all(g.w_avg == 0)
    g.train()
    g.map(z)
    torch.testing.assert_close(g.w_avg, w.mean(0) * (1 - 0.995), rtol=1e-5, atol=1e-7)
    g.eval()
    g.estimate_w_avg(64)
    # psi = 0: every image is the average image; psi = 1: untouched.
    with torch.no_grad():
        avg = g(z, truncation=0.0)
        torch.testing.assert_close(avg, avg[:1].expand_as(avg), rtol=1e-5, atol=1e-5)
        ws = g.styles(z, truncation=0.5)
        torch.testing.assert_close(ws[:, 0], g.w_avg + 0.5 * (w - g.w_avg), rtol=1e-5, atol=1e-6)
        base = g(z)
        torch.testing.assert_close(g(z, truncation=1.0), base)
        # Style mixing: layers >= mix_index use the second latent.
        z2 = torch.randn(3, 16)
        ws = g.styles(z, mix_z=z2, mix_index=3)
        torch.testing.assert_close(ws[:, :3], w[:, None].expand(-1, 3, -1))
        torch.testing.assert_close(ws[:, 3:], g.map(z2)[:, None].expand(-1, g.n_latent - 3, -1))
        mixed = g(z, mix_z=z2, mix_index=3)
        torch.testing.assert_close(mixed, g.synthesis(ws))
        assert not torch.allclose(mixed, base)
        torch.testing.assert_close(g(z, mix_z=z2, mix_index=g.n_latent), base)
        # Seeded sampling: an image depends only on its seed.
        torch.testing.assert_close(g.sample(2, seed=5, batch_size=2)[1:], g.sample(1, seed=6, batch_size=1))


def test_generator_backward_reaches_every_parameter():
    g = tiny_generator()
    randomize(g, 2)  # alpha (position-encoding scale) starts at 0 and would get a zero-only path otherwise
    g(torch.randn(2, 16)).square().mean().backward()
    missing = [n for n, p in g.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing
    assert all(p.grad.abs().sum() > 0 for n, p in g.named_parameters() if "rpb" in n)


def test_position_encoding_layout():
    pe = sinusoidal_grid(3, 5, 16)
    assert pe.shape == (3, 5, 16)
    # First half depends on the column only, second half on the row only; position p starts at 1.
    torch.testing.assert_close(pe[0, :, :8], pe[2, :, :8])
    torch.testing.assert_close(pe[:, 0, 8:], pe[:, 4, 8:])
    torch.testing.assert_close(pe[0, 1, 0], torch.sin(torch.tensor(2.0)))  # column 1 -> p = 2, f_0 = 1
    torch.testing.assert_close(pe[2, 0, 8 + 4 + 3], torch.cos(torch.tensor(3.0) * 10000 ** (-3 / 3)))


def test_fir_filters():
    x = torch.randn(2, 3, 8, 8)
    k = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    # upfirdn2d is a true convolution (flipped kernel) ...
    ref = F.conv2d(x.reshape(6, 1, 8, 8), torch.flip(k, (0, 1))[None, None]).reshape(2, 3, 7, 7)
    torch.testing.assert_close(upfirdn2d(x, k), ref)
    # ... and the Haar pair is a perfect-reconstruction transform.
    torch.testing.assert_close(InverseHaarTransform()(HaarTransform()(x)), x, rtol=1e-5, atol=1e-5)
    from namodels.models.stylegan2 import FIRDownsample, FIRUpsample

    const = torch.full((1, 1, 8, 8), 0.7)
    assert FIRUpsample()(const).shape == (1, 1, 16, 16)
    torch.testing.assert_close(FIRUpsample()(const)[..., 2:-2, 2:-2], torch.full((1, 1, 12, 12), 0.7))
    torch.testing.assert_close(FIRDownsample()(const)[..., 1:-1, 1:-1], torch.full((1, 1, 2, 2), 0.7))


# ------------------------------------------------------------------------------------------------
# Discriminator
# ------------------------------------------------------------------------------------------------


def test_discriminator_shapes_and_minibatch_std():
    torch.manual_seed(0)
    d = StyleNATDiscriminator(**TINY_D)
    out = d(torch.randn(6, 3, 32, 32))
    assert out.shape == (6, 1) and torch.isfinite(out).all()
    assert StyleNATDiscriminator(**TINY_D, sn=False)(torch.randn(2, 3, 32, 32)).shape == (2, 1)
    with pytest.raises(ValueError, match="img"):
        d(torch.randn(2, 3, 64, 64))
    # Minibatch stddev: groups are samples {j, j + B/g, ...}; the extra channel is the mean std.
    mbstd = MinibatchStdDev(group_size=4)
    x = torch.randn(8, 6, 4, 4)
    y = mbstd(x)
    assert y.shape == (8, 7, 4, 4)
    groups = x.view(4, 2, 6, 4, 4)
    expect = torch.sqrt(groups.var(0, unbiased=False) + 1e-8).mean(dim=(1, 2, 3))  # [2]
    torch.testing.assert_close(y[:, 6, 0, 0], expect.repeat(4))
    same = torch.randn(1, 6, 4, 4).expand(4, -1, -1, -1)
    assert mbstd(same)[:, 6].max() < 1e-3
    assert mbstd(torch.randn(6, 6, 4, 4)).shape == (6, 7, 4, 4)  # 6 is not divisible by 4: groups of 3


# ------------------------------------------------------------------------------------------------
# Losses, R1, EMA, lazy regularisation
# ------------------------------------------------------------------------------------------------


def test_losses_and_r1_against_autograd():
    real, fake = torch.randn(5, 1), torch.randn(5, 1)
    torch.testing.assert_close(d_logistic_loss(real, fake),
                               (-torch.log(torch.sigmoid(real))).mean() + (-torch.log(1 - torch.sigmoid(fake))).mean())
    torch.testing.assert_close(g_nonsaturating_loss(fake), (-torch.log(torch.sigmoid(fake))).mean())
    # Toy D(x) = sum(w * x^2): grad_x = 2 w x, so R1 = mean_b sum (2 w x_b)^2.
    w = torch.randn(3, 4, 4, requires_grad=True)
    x = torch.randn(6, 3, 4, 4, requires_grad=True)
    pred = (w * x.square()).flatten(1).sum(1, keepdim=True)
    r1 = r1_penalty(pred, x)
    expect = (2 * w * x).square().flatten(1).sum(1).mean()
    torch.testing.assert_close(r1, expect)
    # create_graph: R1 is differentiable w.r.t. D's parameters (d/dw = mean_b 8 w x^2 summed).
    (gw,) = torch.autograd.grad(r1, w)
    torch.testing.assert_close(gw, (8 * w * x.square()).mean(0))


def test_ema_and_lazy_regularization_hparams():
    assert ema_decay(32) == pytest.approx(0.5 ** (32 / 10000))
    assert ema_decay(64) == pytest.approx(ema_decay(32) ** 2)  # same half-life in images
    assert ema_decay(8, half_life_kimg=0.008) == pytest.approx(0.5)
    lr, betas = lazy_regularization_hparams(2e-4, (0.0, 0.99), 16)
    assert lr == pytest.approx(2e-4 * 16 / 17) and betas == pytest.approx((0.0, 0.99 ** (16 / 17)))
    assert lazy_regularization_hparams(1e-3, (0.5, 0.9), None) == (1e-3, (0.5, 0.9))
    task = GANTask(TINY_G, TINY_D, lr_d=2e-4, r1_interval=16)
    opt_g, opt_d = task.configure_optimizers()
    assert opt_g.param_groups[0]["lr"] == pytest.approx(5e-5)  # TTUR: D lr / 4
    assert opt_d.param_groups[0]["lr"] == pytest.approx(2e-4 * 16 / 17)
    assert opt_d.param_groups[0]["betas"] == pytest.approx((0.0, 0.99 ** (16 / 17)))
    # EMA rule: ema <- decay * ema + (1 - decay) * param, on parameters and buffers (w_avg).
    before = {k: v.clone() for k, v in task.g_ema.state_dict().items()}
    randomize(task.generator, 9)
    task.generator.w_avg.normal_()
    task.ema.decay = 0.9
    task.ema.update(task.generator)
    for k, v in task.g_ema.state_dict().items():
        torch.testing.assert_close(v, 0.9 * before[k] + 0.1 * task.generator.state_dict()[k])


class _Data(L.LightningDataModule):
    def __init__(self, n=12, batch=4, seed=0):
        super().__init__()
        self.data = SkimageCrops(32, length=n, seed=seed)
        self.batch = batch

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch, shuffle=True, drop_last=True)


def _trainer(tmp_path, batches, **kw):
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=100, limit_train_batches=batches, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                     enable_checkpointing=False, **kw)


def test_training_steps_r1_schedule_checkpoint_and_resume(tmp_path, monkeypatch):
    """A few CPU training steps (bCR, style mixing, lazy R1 every 2 D steps): finite losses, every
    network changes, R1 runs on D steps 0 and 2; the checkpoint has both layouts and resumes."""
    import namodels.tasks.gan as gan

    calls = []
    real_r1 = gan.r1_penalty

    def counting_r1(pred, img):
        calls.append(int(task.d_steps))
        return real_r1(pred, img)

    monkeypatch.setattr(gan, "r1_penalty", counting_r1)
    torch.manual_seed(0)
    task = GANTask(TINY_G, TINY_D, r1_interval=2, bcr=True, style_mixing_prob=0.5, max_kimg=0.012,
                   sample_every_n_steps=3, sample_grid=4)
    g0 = {k: v.clone() for k, v in task.generator.state_dict().items()}
    d0 = {k: v.clone() for k, v in task.discriminator.state_dict().items()}
    trainer = _trainer(tmp_path, batches=2)
    trainer.fit(task, _Data())
    assert int(task.d_steps) == 3 and task.images_seen.item() == 12  # 0.012 kimg at batch 4
    assert calls == [0, 2]
    metrics = trainer.callback_metrics
    for key in ("loss/d", "loss/g", "loss/r1", "loss/bcr"):
        assert torch.isfinite(metrics[key]), key
    for name, ref, now in (("g", g0, task.generator.state_dict()), ("d", d0, task.discriminator.state_dict())):
        changed = [k for k in ref if ref[k].is_floating_point() and not torch.equal(ref[k], now[k])]
        assert changed, name
    assert all(torch.isfinite(p).all() for p in task.parameters())
    assert os.path.isfile(tmp_path / "samples" / "kimg00000.012.png")
    # EMA lags the generator.
    assert not torch.equal(task.g_ema.const, task.generator.const)

    path = tmp_path / "gan.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # plain data: loads without unpickling code
    assert set(ckpt["state_dicts"]) == {"g", "g_ema", "d"} and set(ckpt["optim_dicts"]) == {"g_optim", "d_optim"}
    assert ckpt["kimg"] == pytest.approx(0.012)
    # Resume: counters and optimizer states come back; training continues to the new budget.
    task2 = GANTask(TINY_G, TINY_D, r1_interval=2, max_kimg=0.016)
    trainer2 = _trainer(tmp_path, batches=2)
    trainer2.fit(task2, _Data(), ckpt_path=str(path))
    assert task2.images_seen.item() == 16 and int(task2.d_steps) == 4
    assert trainer2.optimizers[1].state  # Adam moments restored / continued
    # The generator loads back from the Lightning checkpoint (EMA by default) for sampling.
    g = load_generator(str(path))
    torch.testing.assert_close(g.const, ckpt["state_dict"]["ema.module.const"])


def test_diff_augment():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16, requires_grad=True)
    y = diff_augment(x)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    flipped = diff_augment(x.detach(), "flip")
    for a, b in zip(flipped, x.detach()):
        assert torch.equal(a, b) or torch.equal(a, b.flip(-1))
    cut = diff_augment(torch.ones(4, 3, 16, 16), "cutout")
    zeros = (cut == 0).float().mean(dim=(1, 2, 3))
    assert torch.all(zeros > 0) and torch.all(zeros <= 0.25 + 1e-6)
    with pytest.raises(ValueError, match="diffaug_policy"):
        diff_augment(x, "flip,rotate")


# ------------------------------------------------------------------------------------------------
# Sampling and FID
# ------------------------------------------------------------------------------------------------


def test_generate_writes_grid_and_seeded_images(tmp_path):
    from PIL import Image

    g = tiny_generator().eval()
    g.estimate_w_avg(128)
    res = generate_images(g, str(tmp_path / "a"), seeds=[3, 7, 11], truncation=0.7, batch_size=2)
    assert os.path.isfile(res["grid"]) and len(res["images"]) == 3
    assert Image.open(res["grid"]).size == (2 + 2 * (128 + 2), 2 + 2 * (128 + 2))  # 2x2 grid, 32 px shown 4x
    again = generate_images(g, str(tmp_path / "b"), seeds=[7], truncation=0.7, grid=False)
    a = torch.from_numpy(np.asarray(Image.open(res["images"][1])).copy())
    b = torch.from_numpy(np.asarray(Image.open(again["images"][0])).copy())
    assert torch.equal(a, b) and a.float().std() > 0
    with pytest.raises(ValueError, match="truncation"):
        generate_images(g, str(tmp_path / "c"), truncation=3.0)
    tp = images_per_second(g, batch_size=2, iters=1, warmup=0, backend="naive")
    assert tp["backend"] == "naive" and tp["images_per_s"] > 0 and tp["median_s"] > 0


def test_images_per_second_runs_on_the_benchmark_step_timer(monkeypatch):
    """Generator throughput is timed by the same helper as the model benchmark, with exactly
    ``warmup + iters`` forwards and the median reported in seconds."""
    import namodels.benchmark.timing as timing

    g = tiny_generator().eval()
    forwards, seen = [], []
    g.register_forward_hook(lambda *_: forwards.append(1))

    def spy(step, device, settings):
        seen.append(settings)
        for _ in range(settings.warmup + settings.iters):
            step()
        return [4.0, 2.0, 3.0]

    monkeypatch.setattr(timing, "time_steps", spy)
    tp = images_per_second(g, batch_size=2, iters=3, warmup=2, backend="naive")
    assert len(forwards) == 5 and (seen[0].warmup, seen[0].iters, seen[0].min_iters) == (2, 3, 3)
    assert tp["median_s"] == pytest.approx(0.003) and tp["images_per_s"] == pytest.approx(2 / 0.003)


class StandIn(nn.Module):
    """Small fixed random conv features standing in for Inception (offline)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(123)
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, 2), nn.ReLU(), nn.Conv2d(16, 8, 3, 2))
        self.num_features = 8

    def forward(self, x):
        return self.net(x.float()).mean(dim=(2, 3))


def test_fid_pipeline_with_stand_in_extractor():
    g = tiny_generator().eval()
    real = [torch.rand(8, 3, 32, 32) * 2 - 1 for _ in range(3)]
    res = compute_fid(g, real, num_fake=24, num_real=20, batch_size=8, feature_extractor=StandIn(), kid=True,
                      kid_subset_size=10)
    assert res["num_real"] == 20 and res["num_fake"] == 24
    assert res["fid"] > 0 and math.isfinite(res["fid"]) and math.isfinite(res["kid_mean"])

    class Fixed(nn.Module):  # a "generator" whose images are exactly the real set
        style_dim = 16

        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.zeros(()))
            self.images = torch.cat(real)

        def seeded_latents(self, seeds):
            return torch.tensor(list(seeds), dtype=torch.float32)[:, None]

        def forward(self, z, truncation=1.0):
            return self.images[z[:, 0].long()]

    same = compute_fid(Fixed(), real, num_fake=24, batch_size=8, feature_extractor=StandIn())
    assert abs(same["fid"]) < 1e-3 < res["fid"]


def test_fid_names_missing_inception_weights(tmp_path):
    with pytest.raises(ValueError, match=INCEPTION_WEIGHTS_FILE):
        inception_weights_path(str(tmp_path))
    with pytest.raises(ValueError, match="inception_weights"):
        compute_fid(tiny_generator(), [torch.zeros(2, 3, 32, 32)], num_fake=2,
                    inception_weights=str(tmp_path / "nope.pth"))
    (tmp_path / INCEPTION_WEIGHTS_FILE).write_bytes(b"x")
    assert inception_weights_path(str(tmp_path)).endswith(INCEPTION_WEIGHTS_FILE)


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------


def test_skimage_crops_and_image_folder(tmp_path):
    from PIL import Image

    ds = SkimageCrops(32, length=5, seed=1)
    a, b = ds[3], SkimageCrops(32, length=5, seed=1)[3]
    assert a.shape == (3, 32, 32) and torch.equal(a, b) and a.min() >= -1 and a.max() <= 1 and a.std() > 0.01
    assert not torch.equal(ds[0], ds[1])
    # FFHQ layout: nested numbered folders of PNGs; any size, resized + center cropped.
    rng = torch.Generator().manual_seed(0)
    for i, sub in enumerate(["00000", "00000", "01000"]):
        os.makedirs(tmp_path / sub, exist_ok=True)
        arr = (torch.rand(40, 60, 3, generator=rng) * 255).byte().numpy()
        Image.fromarray(arr).save(tmp_path / sub / f"{i:05d}.png")
    folder = ImageFolder(str(tmp_path), resolution=16, hflip=False)
    assert len(folder) == 3 and folder.files[-1].endswith(os.path.join("01000", "00002.png"))
    image, skipped = folder[0]
    assert image.shape == (3, 16, 16) and skipped == ()
    dm = GANDataModule(source="folder", root=str(tmp_path), resolution=16, batch_size=2, pin_memory=False)
    images, skipped = next(iter(dm.train_dataloader()))
    assert images.shape == (2, 3, 16, 16) and skipped == []
    with pytest.raises(ValueError, match="root"):
        ImageFolder(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="root"):
        GANDataModule(source="folder")


# ------------------------------------------------------------------------------------------------
# Released checkpoints
# ------------------------------------------------------------------------------------------------


def to_release_layout(state: dict, size: int) -> dict:
    """Our generator state dict rewritten in the release's g_ema layout (legacy split-head rpb0/rpb1,
    MHSARPB rpb + index buffer, two ToRGB biases, fairseq buffers, FIR kernels)."""
    out = {}
    n_stages = int(math.log2(size)) - 1
    for key, value in state.items():
        if key == "w_avg":
            continue
        if key.startswith("mapping.layers."):
            i, rest = key[len("mapping.layers."):].split(".", 1)
            out[f"style.{int(i) + 1}.{rest}"] = value
        elif key == "const":
            out["input.input"] = value
        elif key.startswith("stages."):
            s, rest = key[len("stages."):].split(".", 1)
            if ".attn.rpb." in rest:
                g = rest[-1]
                rest = rest[:-2] if s == "0" else rest[:-2] + g  # 4x4: attn.rpb; else attn.rpb0 / rpb1
                if s == "0":
                    out[f"layers.{s}.{rest.rsplit('.', 1)[0]}.relative_position_index"] = torch.zeros(16, 16).long()
            out[f"layers.{s}.{rest}"] = value
        elif key.endswith(".conv.bias") and key.startswith("to_rgbs."):
            out[key] = value - 0.25  # the release splits the bias in two
            out[key.replace(".conv.bias", ".bias")] = torch.full((1, 3, 1, 1), 0.25)
        else:
            out[key] = value
    for s in range(n_stages - 1):
        out[f"layers.{s}.upsample.sin_pos_embed._float_tensor"] = torch.ones(1)
        out[f"to_rgbs.{s}.upsample.kernel"] = torch.ones(4, 4)
    return out


def test_release_checkpoint_mapping():
    src = randomize(tiny_generator(seed=1), 3).eval()
    release = to_release_layout(src.state_dict(), 32)
    # The synthetic file has the release's names.
    assert "layers.0.blocks.1.attn.rpb" in release and "layers.0.blocks.1.attn.relative_position_index" in release
    assert "layers.2.blocks.0.attn.rpb0" in release and "layers.2.blocks.0.attn.rpb1" in release
    assert "style.1.weight" in release and "style.0.weight" not in release and "input.input" in release
    assert release["to_rgbs.1.bias"].shape == (1, 3, 1, 1)
    converted = convert_official_generator({f"module.{k}": v for k, v in release.items()})
    assert set(converted) == set(src.state_dict()) - {"w_avg"}
    dst = tiny_generator(seed=7).eval()
    for layout in ({"state_dicts": {"g_ema": release, "g": {}, "d": {}}}, {"g_ema": release}):
        load_official_generator(dst, layout, w_avg_samples=64)
        z = torch.randn(2, 16)
        with torch.no_grad():
            torch.testing.assert_close(dst(z), src(z), rtol=1e-5, atol=1e-6)
    assert dst.w_avg.abs().sum() > 0  # estimated, the release carries none
    # Hydra layout (attn.rpb.<g>) passes through; a wrong configuration is reported.
    hydra = {k.replace("attn.rpb0", "attn.rpb.0").replace("attn.rpb1", "attn.rpb.1"): v for k, v in release.items()}
    assert set(convert_official_generator(hydra)) == set(converted)
    with pytest.raises(ValueError, match="checkpoint"):
        load_official_generator(tiny_generator(channels=[32, 32, 32, 16]), {"g_ema": release})
    with pytest.raises(ValueError, match="checkpoint"):
        load_official_generator(dst, {"d": {}})


# ------------------------------------------------------------------------------------------------
# Hydra configs (composition + instantiation only; the runs themselves are covered above)
# ------------------------------------------------------------------------------------------------


def test_configs_compose_and_instantiate():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    with initialize_config_dir(config_dir=root, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=stylenat_skimage"])
        assert cfg.task.name == "gan" and cfg.task.stage == "fit" and cfg.model.name == "stylenat_tiny"
        module = instantiate(cfg.task.module)
        assert isinstance(module, GANTask) and module.generator.size == 32 == cfg.data.resolution
        dm = instantiate(cfg.task.datamodule)
        assert dm.source == "skimage" and dm.batch_size == cfg.data.batch_size
        for exp, size in (("stylenat_ffhq256", 256), ("stylenat_ffhq1024", 1024)):
            c = compose("train", overrides=[f"experiment={exp}", "data.root=/nowhere"])
            assert c.model.generator.size == size and c.data.resolution == size and c.task.module.bcr
            assert OmegaConf.to_container(c.task.module, resolve=True)["discriminator"]["size"] == size
        for task in ("generate", "fid"):
            c = compose("eval", overrides=[f"task={task}", "data=skimage"])
            assert c.task.stage == "eval" and callable(instantiate(c.task.run))
