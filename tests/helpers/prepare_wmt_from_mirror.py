"""``multipath-prepare wmt wmt14_en_de`` against a fake statmt.org mirror whose archives' checksums
are pinned here, as tests/test_prepare.py's ``mirror`` fixture pins them in-process.

Usage: prepare_wmt_from_mirror.py MIRROR_URL RELEASE_ROOT OUT [WORKERS]
"""
import dataclasses
import hashlib
import sys
from pathlib import Path

from multipath_nmt.pipeline import prepare
from multipath_nmt.pipeline.wmt import ARCHIVES, PAIRS

if __name__ == "__main__":
    url, root, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    workers = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    for name in PAIRS["wmt14_en_de"].archives():
        archive = ARCHIVES[name]
        data = (root / archive.url.split("/", 3)[3]).read_bytes()
        ARCHIVES[name] = dataclasses.replace(archive, sha256=hashlib.sha256(data).hexdigest(), md5=None)
    prepare.RETRY_WAIT = 0.0
    prepare.prepare_wmt("wmt14_en_de", out=out, mirror=url, workers=workers, bpe_merges=200)
