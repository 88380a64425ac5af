import subprocess
import sys

import pytest

from engine.block_hash import ROOT_PARENT, hash_block, hash_blocks, make_extra_key

# Pinned digests: changing the hash function must be a visible, deliberate break
# (the Redis index, the offload tiers and the router all key on these bytes).
PINNED = {
    "first_block": "93caf9354f26511f8327ae321df37464",
    "second_block": "98d36d8f0f51b553303731115b479434",
}


def test_pinned_digests():
    hashes = hash_blocks(list(range(8)), 4, make_extra_key("m"))
    assert hashes[0].hex() == PINNED["first_block"]
    assert hashes[1].hex() == PINNED["second_block"]


def test_definition_matches_design_doc():
    import hashlib
    import struct

    extra = make_extra_key("model", "tenant")
    h = hashlib.blake2b(digest_size=16)
    h.update(bytes(16) + extra + struct.pack("<4i", 1, 2, 3, 4))
    assert hash_block(ROOT_PARENT, [1, 2, 3, 4], extra) == h.digest()


def test_chain_and_partial_blocks():
    toks = list(range(10))
    hs = hash_blocks(toks, 4)
    assert len(hs) == 2  # the trailing partial block is not hashed
    assert hs[1] == hash_block(hs[0], toks[4:8])
    assert hash_blocks(toks, 4, start=4, parent=hs[0]) == hs[1:]


def test_salt_and_model_change_every_hash():
    toks = list(range(16))
    a = hash_blocks(toks, 4, make_extra_key("m"))
    b = hash_blocks(toks, 4, make_extra_key("m", "tenant-b"))
    c = hash_blocks(toks, 4, make_extra_key("m2"))
    assert not set(a) & set(b) and not set(a) & set(c)
    assert make_extra_key("ab", "c") != make_extra_key("a", "bc")


def test_bad_arguments():
    with pytest.raises(ValueError):
        hash_blocks([1, 2], 0)
    with pytest.raises(ValueError):
        hash_blocks([1, 2, 3, 4], 2, start=1)
    with pytest.raises(ValueError):
        hash_block(b"short", [1])


def test_torch_free_modules():
    code = ("import sys, engine.block_hash, engine.config, engine.tokenizer, "
            "engine.sampling_params, engine\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
