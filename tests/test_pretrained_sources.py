"""Where every NAT / DiNAT / DiNAT_s pretrained tag gets its weights, an offline load through the Hugging Face hub
cache (no network: sockets are blocked and huggingface_hub runs in offline mode), and without a network one clear
error at once (no retries) that names the local-file route and HF_HUB_OFFLINE=1."""
import os
import re
import socket
import time
import types

import pytest
import timm
import torch

import namodels  # noqa: F401  registers the models
from namodels.models import PretrainedWeightsUnavailable
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

    with pytest.raises(PretrainedWeightsUnavailable, match=r"HF_HUB_OFFLINE is set") as caught:
        timm.create_model("nat_mini", pretrained=True)
    assert isinstance(caught.value.__cause__, LocalEntryNotFoundError)


# --- no network: one clear error at once ---------------------------------------------------------------------------

SHALLOW = dict(depths=(1, 1, 1, 1))  # one block per stage: quick to build, loads the same way


@pytest.fixture
def no_network(tmp_path, monkeypatch):
    """An empty private hub cache, HF_HUB_OFFLINE unset and no route to any host (as DNS fails on a machine without
    network: at once, with OSError); sleeping is refused, so a retry with back-off fails the test."""
    import time

    import huggingface_hub.constants as hf_constants
    import torch.hub

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "torch_hub"))
    attempts = []

    def unreachable(address, *args, **kwargs):
        attempts.append(address)
        raise socket.gaierror(-2, "Name or service not known")

    def refuse(*args, **kwargs):
        raise AssertionError("a socket connected in a test without network")

    def no_sleep(seconds):
        raise AssertionError(f"slept {seconds} s (a retry with back-off)")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(time, "sleep", no_sleep)
    return types.SimpleNamespace(cache=cache, attempts=attempts)


def _check_names_the_ways_on(message, name):
    assert f"timm.create_model({name!r}, pretrained=True, pretrained_cfg_overlay=dict(file='<path>'))" in message
    assert "docs/models.md" in message


def test_no_network_fails_at_once_naming_the_local_file_and_offline_mode(no_network):
    """The hub's own code runs (no request: it is asked for the cache alone once the hub is found unreachable)."""
    started = time.monotonic()
    with pytest.raises(PretrainedWeightsUnavailable) as caught:
        timm.create_model("dinat_mini", pretrained=True)
    assert time.monotonic() - started < 5
    message = str(caught.value)
    _check_names_the_ways_on(message, "dinat_mini")
    assert "HF_HUB_OFFLINE=1" in message and "shi-labs/dinat-mini-in1k-224" in message
    assert "no connection to the Hugging Face hub (huggingface.co:443" in message
    # the connection check, and at most huggingface_hub's own one-off lookup (its user-agent registry, once per
    # process); no retries (sleeping would have failed the test)
    assert no_network.attempts[0] == ("huggingface.co", 443) and len(no_network.attempts) <= 2


def test_connection_error_from_the_hub_download_is_raised_at_once(monkeypatch):
    """The hub reachable a moment before, its download then failing as the hub reports a lost connection
    (LocalEntryNotFoundError, after its own retries): one call, one clear error; timm's fallback to the second file
    name, which would repeat the hub's retries, is not taken."""
    import huggingface_hub
    import huggingface_hub.constants as hf_constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    import namodels.models.pretrained as pretrained

    calls = []

    def failing_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs.get("local_files_only")))
        raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub and we cannot "
                                      "find the requested files in the local cache.")

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(pretrained, "connect_error", lambda url, timeout: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", failing_download)
    with pytest.raises(PretrainedWeightsUnavailable, match="the download failed") as caught:
        timm.create_model("nat_mini", pretrained=True)
    assert calls == [("shi-labs/nat-mini-in1k-224", "model.safetensors", False)]
    _check_names_the_ways_on(str(caught.value), "nat_mini")
    assert "HF_HUB_OFFLINE=1" in str(caught.value)


def test_online_download_asks_for_the_files_timm_asks_for(monkeypatch, tmp_path):
    """With the hub reachable: model.safetensors (absent there), then pytorch_model.bin, which loads."""
    import huggingface_hub
    import huggingface_hub.constants as hf_constants
    from huggingface_hub.errors import EntryNotFoundError

    import namodels.models.pretrained as pretrained

    torch.manual_seed(5)
    expected = timm.create_model("nat_mini", **SHALLOW).state_dict()
    weights = tmp_path / "pytorch_model.bin"
    torch.save(to_hf_layout(expected, "nat"), weights)
    calls = []

    def download(repo_id, filename, **kwargs):
        calls.append((filename, kwargs.get("local_files_only")))
        if filename == "model.safetensors":
            raise EntryNotFoundError("404")
        return str(weights)

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(pretrained, "connect_error", lambda url, timeout: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    model = timm.create_model("nat_mini", pretrained=True, **SHALLOW)
    assert calls == [("model.safetensors", False), ("pytorch_model.bin", False)]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def test_cached_weights_load_without_network_and_without_offline_mode(no_network):
    torch.manual_seed(4)
    expected = timm.create_model("nat_mini", **SHALLOW).state_dict()
    _write_hub_cache(no_network.cache, "shi-labs/nat-mini-in1k-224",
                     {"pytorch_model.bin": lambda p: torch.save(to_hf_layout(expected, "nat"), p)})
    model = timm.create_model("nat_mini", pretrained=True, **SHALLOW)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert no_network.attempts[0] == ("huggingface.co", 443) and len(no_network.attempts) <= 2


def test_url_weights_fail_at_once_without_network(no_network):
    with pytest.raises(PretrainedWeightsUnavailable, match=r"no connection \(shi-labs.com:443") as caught:
        timm.create_model("dinat_s_tiny", pretrained=True)
    _check_names_the_ways_on(str(caught.value), "dinat_s_tiny")
    assert no_network.attempts == [("shi-labs.com", 443)]


def test_connection_check_goes_through_the_proxy(monkeypatch):
    from namodels.models.pretrained import connect_error

    tried = []

    def connect(address, timeout=None):
        tried.append((address, timeout))
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "")
    assert "proxy.internal:3128" in connect_error("https://huggingface.co", 2.0)
    assert tried == [(("proxy.internal", 3128), 2.0)]


def test_readme_snippet_downloads_without_a_local_file():
    """README's timm snippet loads published weights by tag alone, and says how to use a local file."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Models through timm"):]
    section = section[:section.index("\n## ", 1)]
    first_call = re.search(r'timm\.create_model\("dinat_mini", pretrained=True[^)]*\)', section).group(0)
    assert "file=" not in first_call
    assert "pretrained_cfg_overlay=dict(file=" in section and "docs/models.md" in section
