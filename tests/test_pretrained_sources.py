"""Where every NAT / DiNAT / DiNAT_s pretrained tag gets its weights, and an offline load through the
Hugging Face hub cache (no network: sockets are blocked and huggingface_hub runs in offline mode)."""
import os
import re
import socket

import pytest
import timm
import torch

import namodels  # noqa: F401  registers the models
from tests.test_models import to_hf_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The authors' published sources: urls from NAT.md / DiNAT.md of SHI-Labs/Neighborhood-Attention-Transformer,
# hub repositories from huggingface.co/shi-labs (transformers layout).
NAT_URL = "https://shi-labs.com/projects/nat/checkpoints/CLS/"
DINAT_URL = "https://shi-labs.com/projects/dinat/checkpoints/"
EXPECTED = {
    "nat_mini.in1k": (NAT_URL + "nat_mini.pth", "shi-labs/nat-mini-in1k-224"),
    "nat_tiny.in1k": (NAT_URL + "nat_tiny.pth", "shi-labs/nat-tiny-in1k-224"),
    "nat_small.in1k": (NAT_URL + "nat_small.pth", "shi-labs/nat-small-in1k-224"),
    "nat_base.in1k": (NAT_URL + "nat_base.pth", "shi-labs/nat-base-in1k-224"),
    "dinat_mini.in1k": (DINAT_URL + "imagenet1k/dinat_mini_in1k_224.pth", "shi-labs/dinat-mini-in1k-224"),
    "dinat_tiny.in1k": (DINAT_URL + "imagenet1k/dinat_tiny_in1k_224.pth", "shi-labs/dinat-tiny-in1k-224"),
    "dinat_small.in1k": (DINAT_URL + "imagenet1k/dinat_small_in1k_224.pth", "shi-labs/dinat-small-in1k-224"),
    "dinat_base.in1k": (DINAT_URL + "imagenet1k/dinat_base_in1k_224.pth", "shi-labs/dinat-base-in1k-224"),
    "dinat_large.in22k_ft_in1k": (DINAT_URL + "imagenet1k/dinat_large_in22k_in1k_224.pth",
                                  "shi-labs/dinat-large-in22k-in1k-224"),
    "dinat_large.in22k": (DINAT_URL + "imagenet22k/dinat_large_in22k_224.pth", None),
    "dinat_large_384.in22k_ft_in1k": (DINAT_URL + "imagenet1k/dinat_large_in22k_in1k_384.pth",
                                      "shi-labs/dinat-large-in22k-in1k-384"),
    "dinat_large_384_11x11.in22k_ft_in1k": (DINAT_URL + "imagenet1k/dinat_large_in22k_in1k_384_11x11.pth",
                                            "shi-labs/dinat-large-11x11-in22k-in1k-384"),
    "dinat_large_384_11x11.in22k": (DINAT_URL + "imagenet22k/dinat_large_in22k_224_11x11interp.pth", None),
    "dinat_s_tiny.in1k": (DINAT_URL + "imagenet1k/dinat_s_tiny_in1k_224.pth", None),
    "dinat_s_small.in1k": (DINAT_URL + "imagenet1k/dinat_s_small_in1k_224.pth", None),
    "dinat_s_base.in1k": (DINAT_URL + "imagenet1k/dinat_s_base_in1k_224.pth", None),
    "dinat_s_large.in22k_ft_in1k": (DINAT_URL + "imagenet1k/dinat_s_large_in1k_224.pth", None),
    "dinat_s_large.in22k": (DINAT_URL + "imagenet22k/dinat_s_large_in22k_224.pth", None),
    "dinat_s_large_384.in22k_ft_in1k": (DINAT_URL + "imagenet1k/dinat_s_large_in1k_384.pth", None),
}


def _nat_tags():
    return sorted(t for t in timm.list_pretrained("*nat*") if not t.startswith(("video_nat", "nat_digits")))


def test_every_tag_points_at_its_published_source():
    assert _nat_tags() == sorted(EXPECTED)
    for tag, (url, hub_id) in EXPECTED.items():
        cfg = timm.models.get_pretrained_cfg(tag)
        assert (cfg.url, cfg.hf_hub_id) == (url, hub_id), tag


def test_docs_list_every_tag_with_its_source():
    text = open(os.path.join(ROOT, "docs", "models.md")).read()
    for tag, (url, hub_id) in EXPECTED.items():
        rows = [line for line in text.splitlines() if line.startswith(f"| `{tag}` |")]
        assert len(rows) == 1, f"docs/models.md: no table row for {tag}"
        assert url in rows[0], tag
        if hub_id:
            assert f"huggingface.co/{hub_id}" in rows[0], tag
    assert not [line for line in text.splitlines() if line.startswith("| `") and "shilab.cs.uoregon.edu" in line]


def _write_hub_cache(cache, repo_id, files):
    """The folder layout huggingface_hub reads offline: blobs are not needed when snapshots hold the files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, write in files.items():
        write(snapshot / name)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A private hub cache, HF_HUB_OFFLINE=1 and no sockets: a load can only come from the cache."""
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these at import time
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise AssertionError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return cache


@pytest.mark.parametrize("name, prefix", [("nat_mini", "nat"), ("dinat_mini", "dinat")])
def test_pretrained_loads_from_the_hub_cache_offline(offline_hub, name, prefix):
    """``create_model(name, pretrained=True)`` resolves the tag's ``hf_hub_id``, reads the transformers-layout
    ``pytorch_model.bin`` from the cache and maps it through ``checkpoint_filter_fn``."""
    torch.manual_seed(3)
    source = timm.create_model(name)  # random weights, as a stand-in for the published ones
    expected = {k: v.clone() for k, v in source.state_dict().items()}
    hub_id = timm.models.get_pretrained_cfg(name + ".in1k").hf_hub_id
    _write_hub_cache(offline_hub, hub_id, {"pytorch_model.bin": lambda p: torch.save(to_hf_layout(expected, prefix), p)})

    model = timm.create_model(name, pretrained=True)
    assert model.pretrained_cfg["hf_hub_id"] == hub_id
    loaded = model.state_dict()
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


def test_missing_hub_weights_fail_offline_instead_of_downloading(offline_hub):
    from huggingface_hub.errors import LocalEntryNotFoundError

    with pytest.raises(LocalEntryNotFoundError):
        timm.create_model("nat_mini", pretrained=True)


def test_readme_snippet_downloads_without_a_local_file():
    """README's timm snippet loads published weights by tag alone, and says how to use a local file."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Models through timm"):]
    section = section[:section.index("\n## ", 1)]
    first_call = re.search(r'timm\.create_model\("dinat_mini", pretrained=True[^)]*\)', section).group(0)
    assert "file=" not in first_call
    assert "pretrained_cfg_overlay=dict(file=" in section and "docs/models.md" in section
