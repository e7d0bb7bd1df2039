"""Published weights for ``timm.create_model(<name>, pretrained=True)``: fetched the way timm fetches them, but a
machine without network access gets one clear error at once instead of minutes of retries.

timm asks the Hugging Face hub for ``model.safetensors`` and then ``pytorch_model.bin``; without a network the hub
retries each request five times with back-off before it gives up, and timm then tries the next file name: through
timm alone, a load without a network takes over a minute to fail with a generic "check your connection".  Here:

* a tag whose weights are on the hub: one TCP connection to the hub (to its proxy when one is set) is tried first,
  with the hub's own metadata timeout (``HF_HUB_ETAG_TIMEOUT``, 10 s).  Reachable: the same requests timm makes
  (the hub's cache, revisions and retries unchanged), and the file found is handed to timm as
  ``pretrained_cfg_overlay=dict(file=...)``.  Not reachable, or ``HF_HUB_OFFLINE=1``: the hub cache alone
  (``local_files_only``), and :class:`PretrainedWeightsUnavailable` when the weights are not in it;
* a tag whose weights are a URL (the ImageNet-22k and DiNAT_s files): torch's hub cache is used as timm uses it;
  when the file is not there and the host cannot be reached, the same error;
* a connection failure during a download that did start is raised as that error too, chained to the original.

The error names the two ways to go on without a network: a local file through
``pretrained_cfg_overlay=dict(file=...)``, and ``HF_HUB_OFFLINE=1`` with the weights in the hub cache.
"""
from __future__ import annotations

import contextlib
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator

__all__ = ["PretrainedWeightsUnavailable", "with_local_weights", "download_errors", "connect_error"]

HF_WEIGHTS = "pytorch_model.bin"  # timm's default hub file name, tried after its safetensors twin
DEFAULT_CONNECT_TIMEOUT_S = 10.0  # without huggingface_hub (its HF_HUB_ETAG_TIMEOUT otherwise)


class PretrainedWeightsUnavailable(OSError):
    """Published weights are not in the local cache and cannot be downloaded (no network, or HF_HUB_OFFLINE=1)."""


def _message(variant: str, source: str, reason: str, cache: str, hub: bool = True) -> str:
    later = ("or download them once with network access and then run with HF_HUB_OFFLINE=1, which reads the Hugging "
             "Face cache ($HF_HUB_CACHE) without any network request" if hub else
             "or download them once with network access: later loads read the cached copy without a network")
    return (f"{variant}: pretrained weights unavailable: {reason}, and {source} is not in the local cache ({cache}). "
            f"Without a network, load a weights file you have: timm.create_model({variant!r}, pretrained=True, "
            "pretrained_cfg_overlay=dict(file='<path>')) (an official .pth, a transformers pytorch_model.bin or "
            f"model.safetensors, or one of our exports); {later}. docs/models.md lists every tag's source")


def connect_error(url: str, timeout: float) -> str | None:
    """None when a TCP connection to ``url``'s host (or to the proxy the environment sets for it) opens within
    ``timeout`` seconds; otherwise why not, as ``host:port: error``."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)
    proxies = urllib.request.getproxies()  # the *_proxy variables httpx and urllib read
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(host):
        p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        host, port = p.hostname or host, p.port or (443 if p.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as err:  # DNS failure, refused, unreachable, timeout
        return f"{host}:{port}: {err or type(err).__name__}"


def _hub_timeout() -> float:
    try:
        from huggingface_hub import constants

        return float(constants.HF_HUB_ETAG_TIMEOUT)
    except (ImportError, AttributeError):
        return DEFAULT_CONNECT_TIMEOUT_S


def _hub_file(variant: str, hub_id: str, filename: str | None, cache_dir) -> str:
    """The local path of the tag's hub weights: downloaded (or revalidated) when the hub can be reached, from the
    cache alone when not."""
    from huggingface_hub import constants, hf_hub_download
    from timm.models._hub import _get_safe_alternatives, hf_split

    try:
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
    except ImportError:  # huggingface_hub < 0.24
        from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError

    repo, revision = hf_split(hub_id)
    filename = filename or HF_WEIGHTS
    names = [filename] if filename.endswith(".safetensors") else [*_get_safe_alternatives(filename), filename]
    if constants.HF_HUB_OFFLINE:
        reason = "HF_HUB_OFFLINE is set"
    else:
        failed = connect_error(constants.ENDPOINT, _hub_timeout())
        reason = f"no connection to the Hugging Face hub ({failed})" if failed else None
    cache = str(cache_dir or constants.HF_HUB_CACHE)
    source = f"{constants.ENDPOINT}/{repo} ({' or '.join(names)})"
    missing = None
    for name in names:  # timm's order: the safetensors file first
        try:
            return hf_hub_download(repo, name, revision=revision, cache_dir=cache_dir,
                                   local_files_only=reason is not None)
        except LocalEntryNotFoundError as err:
            if reason is None:
                # the hub was reachable a moment ago but the request failed (its retries are spent): stop here
                raise PretrainedWeightsUnavailable(_message(variant, source, "the download failed", cache)) from err
            missing = err  # not cached under this name: the next name may be
        except EntryNotFoundError as err:  # not published under this name (the hub answered 404)
            missing = err
    if reason is not None:
        raise PretrainedWeightsUnavailable(_message(variant, source, reason, cache)) from missing
    raise missing


def _url_cache(url: str, cache_dir) -> str:
    import torch.hub

    folder = cache_dir or os.path.join(torch.hub.get_dir(), "checkpoints")  # where timm's url loader looks
    return os.path.join(str(folder), os.path.basename(urllib.parse.urlparse(url).path))


def _source(cfg: dict) -> tuple[str, str | None]:
    """Where timm will load the weights of a resolved pretrained cfg from: ("local", None), ("hf-hub", id),
    ("url", url) (timm.models._builder._resolve_pretrained_source's order)."""
    from timm.models._hub import has_hf_hub

    if cfg.get("source") == "local-dir" or cfg.get("state_dict") is not None or cfg.get("file"):
        return "local", None
    hub_id = cfg.get("hf_hub_id")
    if hub_id and (cfg.get("source") == "hf-hub" or has_hf_hub()):
        return "hf-hub", hub_id
    if cfg.get("url"):
        return "url", cfg["url"]
    return "local", None


def with_local_weights(variant: str, pretrained: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``build_model_with_cfg`` keyword arguments for ``variant``: with ``pretrained``, the published hub weights
    are fetched here (see the module docstring) and passed on as ``pretrained_cfg_overlay=dict(file=<cached
    path>)``; a URL source is checked for a cached copy or a reachable host.  Raises
    :class:`PretrainedWeightsUnavailable` when neither holds."""
    if not pretrained:
        return kwargs
    from timm.models._builder import resolve_pretrained_cfg

    overlay = kwargs.get("pretrained_cfg_overlay")
    cfg = resolve_pretrained_cfg(variant, pretrained_cfg=kwargs.get("pretrained_cfg"),
                                 pretrained_cfg_overlay=overlay).to_dict()
    kind, where = _source(cfg)
    if kind == "hf-hub":
        path = _hub_file(variant, where, cfg.get("hf_hub_filename"), kwargs.get("cache_dir"))
        return dict(kwargs, pretrained_cfg_overlay=dict(overlay or {}, file=path))
    if kind == "url":
        cached = _url_cache(where, kwargs.get("cache_dir"))
        if not os.path.isfile(cached):
            failed = connect_error(where, _hub_timeout())
            if failed:
                raise PretrainedWeightsUnavailable(_message(variant, where, f"no connection ({failed})",
                                                            os.path.dirname(cached), hub=False))
    return kwargs


@contextlib.contextmanager
def download_errors(variant: str, pretrained: bool) -> Iterator[None]:
    """Connection failures while timm downloads a URL source raise :class:`PretrainedWeightsUnavailable`."""
    if not pretrained:
        yield
        return
    try:
        yield
    except (urllib.error.URLError, ConnectionError, socket.timeout) as err:
        if isinstance(err, urllib.error.HTTPError):  # the server answered: not a connection problem
            raise
        raise PretrainedWeightsUnavailable(_message(variant, "the published weights file",
                                                    f"the download failed ({err})", "torch.hub.get_dir()/checkpoints",
                                                    hub=False)) from err
