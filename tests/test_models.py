"""NAT / DiNAT / DiNAT_s in the timm registry: names, parameter counts, official checkpoint layouts,
parity with an independent reference forward (tests/reference_nat.py), timm model conventions.

Tolerances: logits of our float32 model vs the float64 reference, relative L2 error < 1e-4.
"""
from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2

import namodels  # noqa: F401  (registers the models)
import ops
from namodels.models.layers import fit_window
from namodels.models.nat import dilated
from tests.oracle import oracle_attention
from tests.reference_nat import dinat_s_logits, nat_logits, neighborhood_attention_2d

KEYS_JSON = Path("/work/shared/reference/nat_official_state_dict_keys.json")
OFFICIAL_PARAMS = {
    "nat_mini": 19_984_174, "nat_tiny": 27_901_582, "nat_small": 50_743_297, "nat_base": 89_769_652,
    "dinat_mini": 19_984_174, "dinat_tiny": 27_901_582, "dinat_small": 50_719_681, "dinat_base": 89_769_652,
    "dinat_large": 200_943_514, "dinat_large_384": 200_943_514, "dinat_large_384_11x11": 201_144_250,
    "dinat_s_tiny": 28_288_354, "dinat_s_small": 49_606_258, "dinat_s_base": 87_768_224,
    "dinat_s_large": 196_532_476, "dinat_s_large_384": 196_532_476,
}
# official weight files of the same architectures under another name
OFFICIAL_ALIASES = {"dinat_large_21k": "dinat_large", "dinat_large_21k_11x11": "dinat_large_384_11x11",
                    "dinat_s_large_21k": "dinat_s_large"}
TINY = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4))  # cheap NAT for convention tests
REL_TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def official_keys() -> dict:
    if not KEYS_JSON.exists():
        pytest.skip(f"{KEYS_JSON} not available")
    return _load_keys()


@functools.lru_cache(maxsize=1)
def _load_keys() -> dict:
    return json.loads(KEYS_JSON.read_text())


def synthetic_weights(shapes, seed: int = 0) -> dict:
    """Random tensors of the given (name, shape) list, scaled so every path matters in the logits
    (random RPB of order 1, norm weights around 1, layer-scale gammas of order 0.5)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes:
        r = torch.randn(*shape, generator=g)
        if name.endswith("rpb"):
            out[name] = r
        elif "norm" in name and name.endswith("weight"):
            out[name] = 1 + 0.2 * r
        elif "gamma" in name:
            out[name] = 0.5 * r
        elif len(shape) == 1:
            out[name] = 0.2 * r
        else:
            out[name] = r / math.sqrt(math.prod(shape[1:]))
    return out


def arch_of(model):
    """(depths, heads, kernel, dilations) read off a built model, for the reference forward."""
    stages = model.stages
    depths = [len(s.blocks) for s in stages]
    heads = [s.blocks[0].attn.num_heads for s in stages]
    kernel = stages[0].blocks[0].attn.kernel_size[0]
    dilations = [[b.attn.dilation[0] for b in s.blocks] for s in stages]
    return depths, heads, kernel, dilations


def reference_logits(model, state_dict, x, dilation_mode):
    depths, heads, kernel, dilations = arch_of(model)
    fn = dinat_s_logits if model.stage_attr == "layers" else nat_logits
    sd = {k: v.double() for k, v in state_dict.items()}
    return fn(sd, x.double(), depths, heads, kernel, dilations, dilation_mode)


def save_official(tmp_path, name: str, seed: int = 0):
    sd = synthetic_weights(official_keys()[name], seed)
    path = tmp_path / f"{name}.pth"
    torch.save(sd, path)
    return sd, path


# --- registry, parameter counts, key layout ------------------------------------------------------------

def test_every_published_variant_is_registered_with_tags():
    names = set(timm.list_models(["nat_*", "dinat_*"]))
    assert set(OFFICIAL_PARAMS) <= names
    tags = set(timm.list_pretrained(["nat_*", "dinat_*"]))
    for expected in ("nat_mini.in1k", "dinat_base.in1k", "dinat_large.in22k_ft_in1k", "dinat_large.in22k",
                     "dinat_large_384.in22k_ft_in1k", "dinat_large_384_11x11.in22k_ft_in1k",
                     "dinat_s_tiny.in1k", "dinat_s_large.in22k", "dinat_s_large_384.in22k_ft_in1k"):
        assert expected in tags


@pytest.mark.parametrize("name", sorted(OFFICIAL_PARAMS))
def test_parameter_count_and_official_key_layout(name):
    with torch.device("meta"):
        model = timm.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == OFFICIAL_PARAMS[name]
    ours = [(k, list(v.shape)) for k, v in model.state_dict().items()]
    keys = official_keys()
    for official_name in [name] + [a for a, n in OFFICIAL_ALIASES.items() if n == name]:
        assert ours == [tuple(kv) for kv in keys[official_name]], official_name  # same names, shapes, order


def test_pretrained_cfgs():
    for tag in timm.list_pretrained(["nat_*", "dinat_*"]):
        cfg = timm.get_pretrained_cfg(tag).to_dict()
        assert cfg["interpolation"] == "bicubic"
        assert cfg["mean"] == timm.data.IMAGENET_DEFAULT_MEAN and cfg["std"] == timm.data.IMAGENET_DEFAULT_STD
        assert cfg["crop_pct"] == (1.0 if cfg["input_size"][-1] == 384 else 0.875)
        assert cfg["license"] == "mit" and "SHI-Labs" in cfg["origin_url"]
        assert cfg["url"].startswith("https://") and cfg["url"].endswith(".pth")
        assert cfg["num_classes"] == (21841 if tag.endswith(".in22k") else 1000)
    keys = set(k for k, _ in official_keys()["nat_mini"])
    cfg = timm.get_pretrained_cfg("nat_mini").to_dict()
    assert cfg["first_conv"] + ".weight" in keys and cfg["classifier"] + ".weight" in keys
    s_keys = set(k for k, _ in official_keys()["dinat_s_tiny"])
    s_cfg = timm.get_pretrained_cfg("dinat_s_tiny").to_dict()
    assert s_cfg["first_conv"] + ".weight" in s_keys and s_cfg["classifier"] + ".weight" in s_keys


# --- the reference itself -------------------------------------------------------------------------------

@pytest.mark.parametrize("H,W,K,dh,dw", [(7, 9, 3, 1, 2), (13, 11, 3, 4, 3), (14, 14, 7, 2, 1), (21, 17, 5, 4, 3)])
def test_reference_attention_matches_dense_oracle(H, W, K, dh, dw):
    """The reference's closed-form (old NATTEN kernel) windows equal the rules of docs/semantics.md."""
    g = torch.Generator().manual_seed(H * W + K)
    q, k, v = (torch.randn(2, H, W, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    rpb = torch.randn(3, 2 * K - 1, 2 * K - 1, generator=g, dtype=torch.float64)
    ours = neighborhood_attention_2d(q, k, v, rpb, K, (dh, dw))
    expected, _ = oracle_attention(q, k, v, (H, W), (K, K), (1, 1), (dh, dw), (False, False), rpb=rpb)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


# --- official checkpoints: strict loading and logits ----------------------------------------------------

@pytest.mark.parametrize("name,size,mode", [
    ("nat_mini", 64, "clamp"),  # stages 4x4 and 2x2 are padded to the 7x7 window
    ("dinat_mini", 112, "clamp"),  # dilations 4 and 2 run (8 clamped to 4 at 28x28, 4 to 2 at 14x14)
    ("dinat_mini", 64, "pad"),  # official behaviour: dilation 8 at 16x16 padded to 56x56
    ("dinat_s_tiny", 100, "clamp"),  # stem pads 100 -> 104, odd 13x13 stage padded before merging
])
def test_official_weights_load_strictly_and_reproduce_reference_logits(tmp_path, name, size, mode):
    sd, path = save_official(tmp_path, name)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                              backend="naive", dilation_mode=mode).eval()
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k  # every tensor came from the file (strict load, no renaming)
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(size))
    with torch.no_grad():
        logits = model(x)
    expected = reference_logits(model, sd, x, mode)
    assert logits.dtype == torch.float32 and logits.shape == (1, 1000)
    assert rel_err(logits, expected) < REL_TOL


def test_reference_parity_detects_a_wrong_model(tmp_path):
    """Negative control: transposing one RPB table (a plausible porting bug) breaks parity."""
    model = timm.create_model("nat_mini", backend="naive", **TINY).eval()
    sd = synthetic_weights([(k, list(v.shape)) for k, v in model.state_dict().items()])
    model.load_state_dict(sd)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(model(x), reference_logits(model, sd, x, "clamp")) < REL_TOL
        rpb = model.levels[0].blocks[0].attn.rpb
        rpb.copy_(rpb.transpose(-1, -2).clone())
        assert rel_err(model(x), reference_logits(model, sd, x, "clamp")) > 1e-3


def test_layer_scale_model_matches_reference():
    """gamma1/gamma2 path (nat_small/base, dinat_base) on a cheap architecture with the same layout."""
    model = timm.create_model("nat_mini", backend="naive", layer_scale=1e-5, **TINY).eval()
    sd = synthetic_weights([(k, list(v.shape)) for k, v in model.state_dict().items()], seed=3)
    assert any(k.endswith("gamma1") for k in sd)
    model.load_state_dict(sd)
    x = torch.randn(2, 3, 48, 80)  # non-square
    with torch.no_grad():
        assert rel_err(model(x), reference_logits(model, sd, x, "clamp")) < REL_TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nat_mini", "dinat_mini", "dinat_s_tiny"])
def test_reference_logits_at_training_resolution(tmp_path, name):
    """224x224: no padding and no clamping anywhere (dilations 8, 4, 2 as trained)."""
    sd, path = save_official(tmp_path, name, seed=1)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                              backend="naive").eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        logits = model(x)
    for mode in ("clamp", "pad"):  # identical at the training resolution
        assert rel_err(logits, reference_logits(model, sd, x, mode)) < REL_TOL


def to_hf_layout(sd: dict, prefix: str) -> dict:
    """Official NAT/DiNAT names -> Hugging Face transformers names (written independently of the filter)."""
    out = {}
    block_names = {"norm1": "layernorm_before", "attn.rpb": "attention.self.rpb", "attn.proj": "attention.output.dense",
                   "norm2": "layernorm_after", "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}
    gammas = {}
    for k, v in sd.items():
        m = re.match(r"levels\.(\d+)\.blocks\.(\d+)\.(.*)", k)
        if m:
            i, j, rest = m.groups()
            base = f"{prefix}.encoder.levels.{i}.layers.{j}."
            if rest.startswith("attn.qkv."):
                leaf = rest.split(".")[-1]
                for part, t in zip(("query", "key", "value"), v.chunk(3, dim=0)):
                    out[f"{base}attention.self.{part}.{leaf}"] = t.clone()
            elif rest in ("gamma1", "gamma2"):
                gammas.setdefault(base, {})[rest] = v
            else:
                for ours, theirs in block_names.items():
                    if rest.startswith(ours):
                        out[base + theirs + rest[len(ours):]] = v
                        break
                else:
                    raise AssertionError(rest)
        elif k.startswith("levels."):
            out[f"{prefix}.encoder.{k}"] = v
        elif k.startswith("patch_embed.proj."):
            out[f"{prefix}.embeddings.patch_embeddings.projection." + k[len("patch_embed.proj."):]] = v
        elif k.startswith("patch_embed.norm."):
            out[f"{prefix}.embeddings.norm." + k[len("patch_embed.norm."):]] = v
        elif k.startswith("norm."):
            out[f"{prefix}.layernorm." + k[len("norm."):]] = v
        elif k.startswith("head."):
            out["classifier." + k[len("head."):]] = v
        else:
            raise AssertionError(k)
    for base, g in gammas.items():
        out[base + "layer_scale_parameters"] = torch.stack([g["gamma1"], g["gamma2"]])
    return out


TINY_DINAT_LS = dict(TINY, layer_scale=1e-5, dilations=dilated(TINY["depths"], (2, 2, 1, 1)))


@pytest.mark.parametrize("name,prefix,kwargs", [("nat_mini", "nat", {}), ("dinat_mini", "dinat", TINY_DINAT_LS)])
def test_hugging_face_layout_loads(tmp_path, name, prefix, kwargs):
    reference = timm.create_model(name, **kwargs)
    sd = synthetic_weights([(k, list(v.shape)) for k, v in reference.state_dict().items()], seed=5)
    hf = to_hf_layout(sd, prefix)
    assert any(".attention.self.query." in k for k in hf)
    path = tmp_path / "pytorch_model.bin"
    torch.save(hf, path)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs)
    loaded = model.state_dict()
    assert set(loaded) == set(sd)
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k


def test_other_num_classes_keeps_backbone_and_drops_head(tmp_path):
    sd, path = save_official(tmp_path, "dinat_s_tiny")
    model = timm.create_model("dinat_s_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                              num_classes=10)
    assert model.head.weight.shape == (10, 768)
    assert torch.equal(model.layers[2].blocks[3].attn.rpb, sd["layers.2.blocks.3.attn.rpb"])


def test_checkpoint_wrappers_and_rpb_resize(tmp_path):
    """{'model': sd} / DDP 'module.' prefixes load; a 7x7 RPB table is bicubic-resized for an 11x11 model."""
    kw = dict(TINY, backend="naive")
    small = timm.create_model("nat_mini", **kw)
    sd = synthetic_weights([(k, list(v.shape)) for k, v in small.state_dict().items()], seed=7)
    path = tmp_path / "wrapped.pth"
    torch.save({"model": {"module." + k: v for k, v in sd.items()}, "epoch": 3}, path)
    big = timm.create_model("nat_mini", kernel_size=11, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                            **kw)
    rpb = big.levels[0].blocks[0].attn.rpb
    assert rpb.shape == (1, 21, 21)
    assert torch.equal(big.levels[0].blocks[0].attn.qkv.weight, sd["levels.0.blocks.0.attn.qkv.weight"])
    # the resized table still spans the original values' range (an interpolation, not a re-init)
    src = sd["levels.0.blocks.0.attn.rpb"]
    assert rpb.max() > 0.5 * src.max() and rpb.min() < 0.5 * src.min()


# --- timm conventions -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return timm.create_model("dinat_mini", backend="naive", dilations=dilated(TINY["depths"], (2, 2, 1, 1)),
                             **TINY).eval()


def test_forward_features_head_and_classifier(tiny):
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        feats = tiny.forward_features(x)
        assert feats.shape == (2, 2, 3, tiny.num_features) and tiny.output_fmt == "NHWC"
        pooled = tiny.forward_head(feats, pre_logits=True)
        assert pooled.shape == (2, tiny.num_features) == (2, tiny.head_hidden_size)
        torch.testing.assert_close(tiny.forward_head(feats), tiny(x))
        torch.testing.assert_close(tiny.get_classifier()(pooled), tiny(x))
    model = timm.create_model("nat_mini", backend="naive", **TINY)
    model.reset_classifier(7)
    assert model.get_classifier().out_features == 7 and model(x).shape == (2, 7)
    model.reset_classifier(0, "")
    assert model(x).shape == (2, 2, 3, model.num_features)  # unpooled, no head
    with pytest.raises(ValueError, match="global_pool"):
        model.reset_classifier(3, "max")


def test_features_only(tiny):
    model = timm.create_model("dinat_s_tiny", features_only=True, backend="naive", embed_dim=24,
                              depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), dilations=[[1], [1], [1], [1]])
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    assert model.feature_info.channels() == [24, 48, 96, 192]
    feats = model(torch.randn(1, 3, 96, 64))
    assert [tuple(f.shape) for f in feats] == [(1, 24, 24, 16), (1, 48, 12, 8), (1, 96, 6, 4), (1, 192, 3, 2)]
    partial = timm.create_model("nat_mini", features_only=True, out_indices=(1, 2), backend="naive", **TINY)
    assert partial.feature_info.reduction() == [8, 16]
    assert [f.shape[1] for f in partial(torch.randn(1, 3, 64, 64))] == [32, 64]


def test_forward_intermediates(tiny):
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        final, inter = tiny.forward_intermediates(x)
        assert [tuple(t.shape) for t in inter] == [(1, 16, 16, 16), (1, 32, 8, 8), (1, 64, 4, 4), (1, 128, 2, 2)]
        torch.testing.assert_close(final, tiny.forward_features(x))
        last = tiny.forward_intermediates(x, indices=1, norm=True, output_fmt="NHWC", intermediates_only=True)
        torch.testing.assert_close(last[0], final)  # normed last stage == forward_features
        early = tiny.forward_intermediates(x, indices=[0, 1], stop_early=True, intermediates_only=True)
        torch.testing.assert_close(early[1], inter[1])
    with pytest.raises(ValueError, match="output_fmt"):
        tiny.forward_intermediates(x, output_fmt="NLC")


def test_prune_intermediate_layers():
    model = timm.create_model("nat_mini", backend="naive", **TINY).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model.forward_intermediates(x, indices=(0, 1), intermediates_only=True)
        kept = model.prune_intermediate_layers((0, 1))
        assert kept == [0, 1] and len(model.levels) == 2 and isinstance(model.norm, torch.nn.Identity)
        got = model.forward_intermediates(x, indices=(0, 1), intermediates_only=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_forward_backward_and_grad_checkpointing():
    torch.manual_seed(1)
    arch = dict(TINY, depths=(2, 1, 1, 1))
    model = timm.create_model("dinat_mini", backend="naive", drop_path_rate=0.0,
                              dilations=dilated(arch["depths"], (2, 1, 1, 1)), **arch)
    assert model.levels[0].blocks[1].attn.dilation == (2, 2)  # runs dilated: 16 // 7 = 2
    x = torch.randn(2, 3, 64, 64)
    loss = model(x).logsumexp(-1).sum()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["levels.0.blocks.1.attn.rpb"].abs().sum() > 0  # dilated block's bias learns
    model.zero_grad()
    model.set_grad_checkpointing(True)
    assert all(stage.grad_checkpointing for stage in model.levels)
    model(x).logsumexp(-1).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], rtol=1e-4, atol=1e-6)


def test_attention_dropout_path_with_clamped_dilation():
    """Training with attention dropout goes through the unfused qk/av ops, also with a clamped dilation;
    with a vanishing drop probability it equals the inference path."""
    arch = dict(TINY, depths=(2, 1, 1, 1))
    model = timm.create_model("dinat_mini", backend="naive", attn_drop_rate=0.5, drop_path_rate=0.0,
                              dilations=dilated(arch["depths"], (8, 1, 1, 1)), **arch)
    x = torch.randn(1, 3, 64, 64)  # level 0 is 16x16: dilation 8 clamps to 2
    model.eval()
    with torch.no_grad():
        expected = model(x)
        model.train()
        assert not torch.allclose(model(x), expected)  # weights are dropped
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout) and m.p == 0.5:
                m.p = 1e-12
        torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)


def test_no_weight_decay_and_group_matcher():
    model = timm.create_model("nat_mini", layer_scale=1e-5, **TINY)
    nwd = model.no_weight_decay()
    names = dict(model.named_parameters())
    assert "levels.0.blocks.0.attn.rpb" in nwd and "levels.0.blocks.0.gamma1" in nwd
    assert "levels.1.blocks.0.norm1.weight" in nwd and "levels.1.blocks.0.mlp.fc1.bias" in nwd and "norm.bias" in nwd
    assert "levels.0.blocks.0.attn.qkv.weight" not in nwd and "head.weight" not in nwd
    assert nwd <= set(names)
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(names["levels.0.blocks.0.attn.rpb"]) not in decayed
    assert id(names["levels.0.blocks.0.attn.qkv.weight"]) in decayed
    # layer-wise lr decay groups: stem first, blocks in depth order, every parameter in exactly one group
    layered = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.8)
    assert sum(len(g["params"]) for g in layered.param_groups) == len(names)
    scales = {id(p): g["lr_scale"] for g in layered.param_groups for p in g["params"]}
    scale = {name: scales[id(p)] for name, p in names.items()}
    assert scale["patch_embed.proj.0.weight"] < scale["levels.0.blocks.0.attn.qkv.weight"]
    assert scale["levels.0.blocks.0.attn.qkv.weight"] < scale["levels.0.downsample.reduction.weight"]
    assert scale["levels.0.downsample.reduction.weight"] <= scale["levels.1.blocks.0.norm1.weight"]
    assert scale["levels.3.blocks.0.mlp.fc2.weight"] <= scale["head.weight"]
    coarse = model.group_matcher(coarse=True)
    assert re.match(coarse["blocks"], "levels.2.downsample.norm.weight")


# --- backends, small inputs, compile --------------------------------------------------------------------

def test_backend_constructor_argument_and_context_manager(monkeypatch):
    calls = []
    real = ops.naive.BACKEND.attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops.naive.BACKEND, "attention", spy)
    model = timm.create_model("nat_mini", backend="naive", **TINY).eval()
    assert all(b.attn.backend == "naive" for s in model.levels for b in s.blocks)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        y = model(x)
        assert len(calls) == sum(TINY["depths"])
        auto = timm.create_model("nat_mini", **TINY).eval()
        auto.load_state_dict(model.state_dict())
        calls.clear()
        with ops.use_backend("naive"):
            y2 = auto(x)
        assert len(calls) == sum(TINY["depths"])
        calls.clear()
        y3 = auto(x)  # automatic selection: whichever backend serves CPU first; same numbers
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(y3, y, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="backend"):
        timm.create_model("nat_mini", backend="no-such-backend", **TINY)(x)


def test_fit_window_rules():
    assert fit_window((28, 20), (7, 7), (8, 8), "clamp") == ((4, 2), (28, 20))
    assert fit_window((5, 56), (7, 7), (8, 8), "clamp") == ((1, 8), (7, 56))
    assert fit_window((28, 60), (7, 7), (8, 8), "pad") == ((8, 8), (56, 60))
    assert fit_window((3, 3), (7, 7), (1, 1), "pad") == ((1, 1), (7, 7))
    with pytest.raises(ValueError, match="dilation_mode"):
        fit_window((8, 8), (3, 3), (1, 1), "crop")
    with pytest.raises(ValueError, match="dilation_mode"):
        timm.create_model("nat_mini", dilation_mode="crop", **TINY)


def test_tiny_inputs_are_padded_and_bad_inputs_raise():
    model = timm.create_model("nat_mini", backend="naive", **TINY).eval()
    sd = synthetic_weights([(k, list(v.shape)) for k, v in model.state_dict().items()], seed=9)
    model.load_state_dict(sd)
    x = torch.randn(1, 3, 20, 36)  # stages 5x9, 3x5, 2x3, 1x2: all smaller than 7 on some axis
    with torch.no_grad():
        assert rel_err(model(x), reference_logits(model, sd, x, "clamp")) < REL_TOL
    with pytest.raises(ValueError, match="x: expected an image batch"):
        model(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match="dilations"):
        timm.create_model("dinat_mini", dilations=[[1, 2]], **TINY)


def test_torch_compile_captures_one_graph():
    """Dynamo traces the whole model (NA calls included) without graph breaks; same outputs."""
    model = timm.create_model("nat_mini", backend="naive", **TINY).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), expected)


@pytest.mark.slow
def test_torch_compile_nat_mini_inductor():
    """Full inductor compile of nat_mini's forward (several minutes on 2 CPU cores)."""
    model = timm.create_model("nat_mini", backend="naive").eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        assert rel_err(compiled(x), expected) < REL_TOL


def test_fast_norm_swaps_every_layernorm_and_keeps_weights():
    """``fast_norm=True`` builds every LayerNorm (stem, blocks, downsamplers, final) on the Triton kernel, with the
    same state_dict, so checkpoints load either way; on CPU it computes what torch's LayerNorm does."""
    from ops.layer_norm import LayerNorm as FastLayerNorm

    fast = timm.create_model("dinat_mini", fast_norm=True, backend="naive", **TINY_DINAT_LS).eval()
    plain = timm.create_model("dinat_mini", backend="naive", **TINY_DINAT_LS).eval()
    norms = [m for m in plain.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and sum(isinstance(m, FastLayerNorm) for m in fast.modules()) == len(norms)
    assert not any(isinstance(m, FastLayerNorm) for m in plain.modules())
    plain.load_state_dict(fast.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), plain(x))


@pytest.mark.parametrize("name, kwargs", [("nat_digits", {}), ("video_nat_nano", dict(img_size=32)),
                                          ("nat_mini", {}), ("dinat_s_tiny", {})])
def test_classifier_hooks_are_shared(name, kwargs):
    """timm's ``get_classifier`` / ``set_grad_checkpointing`` come from one mixin; NAT-family models also
    switch their stages."""
    from namodels.models.backbone import ClassifierHooks, NABackbone

    model = timm.create_model(name, num_classes=5, **kwargs)
    assert isinstance(model, ClassifierHooks) and model.get_classifier() is model.head
    stages = list(model.stages) if isinstance(model, NABackbone) else []
    assert stages or name in ("nat_digits", "video_nat_nano")
    for enable in (True, False):
        model.set_grad_checkpointing(enable)
        assert model.grad_checkpointing is enable and all(s.grad_checkpointing is enable for s in stages)


def test_dinat_s_fast_norm_swaps_every_layernorm_and_keeps_weights():
    """DiNAT_s takes NAT's ``fast_norm``: every LayerNorm (stem, blocks, patch merging, final) on the Triton kernel,
    same state_dict; on CPU it computes what torch's LayerNorm does."""
    from ops.layer_norm import LayerNorm as FastLayerNorm

    tiny = dict(TINY, dilations=dilated(TINY["depths"], (2, 2, 1, 1)), backend="naive")
    fast = timm.create_model("dinat_s_tiny", fast_norm=True, **tiny).eval()
    plain = timm.create_model("dinat_s_tiny", **tiny).eval()
    norms = [name for name, m in plain.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    assert {name.split(".")[0] for name in norms} == {"patch_embed", "layers", "norm"}
    assert any(".downsample." in name for name in norms) and any(".blocks." in name for name in norms)
    assert [name for name, m in fast.named_modules() if isinstance(m, FastLayerNorm)] == norms
    assert not any(isinstance(m, FastLayerNorm) for m in plain.modules())
    plain.load_state_dict(fast.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), plain(x))
