"""Copies a tuning cache written before session 12's ``autotune.CODE_VERSION`` key field (or under another version) to
today's version, so that the session's benchmark runs keep choices that were re-checked on the GPU.

    python3 rekey_cache.py SRC [SRC ...] DST

Several sources are merged, later ones winning on equal keys.

Drops the RPB backward entries (dQ / dK/dV with RPB), which session 11 found stale (chosen before the backward's
host descriptors).  The forward entries of session 10's tuner and the three stride entries set by hand in session 12
(call 2's A/B) are carried over as they are."""
import json
import sys

sys.path.insert(0, ".")
from ops.fused import autotune  # noqa: E402

*sources, dst = sys.argv[1:]
entries = {}
for src in sources:
    entries.update(json.load(open(src)))
out = {}
for key, entry in entries.items():
    fields = key.split("|")
    if fields[-1].startswith("v") and len(fields) == 16:
        fields = fields[:-1]
    if fields[0] in ("dq", "dkdv") and fields[-2] == "1":  # RPB backward: stale
        continue
    out["|".join(fields + [f"v{autotune.CODE_VERSION}"])] = entry
json.dump(out, open(dst, "w"), indent=1, sort_keys=True)
print(f"{len(out)} of {len(entries)} entries -> {dst} (v{autotune.CODE_VERSION})")
