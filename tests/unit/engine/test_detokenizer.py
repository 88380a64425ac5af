"""Incremental detokenization: the text a stream shows token by token is the text of the
whole output decoded at once, on the tokenizer's own stream (DecodeStream) as on the
offsets it falls back to, for byte-level BPE (Llama 3, Qwen) and byte-fallback
SentencePiece-style BPE (Llama 2, Mistral), with special tokens and multi-byte
characters split across tokens."""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterator

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.default_model import _CORPUS, write_tokenizer
from engine.detokenizer import PROMPT_TAIL, IncrementalDetokenizer
from engine.tokenizer import Tokenizer

# Characters of 2, 3 and 4 UTF-8 bytes: byte-level tokens split them.
TEXT = ("The naïve café served 中文字符 and 😀 emoji; 日本語 text follows. Ünïcödé "
        "ends here, then the quick brown fox.")


def byte_fallback_tokenizer(model_dir: str) -> None:
    """A Llama 2 / Mistral style tokenizer.json: SentencePiece BPE with byte fallback
    (<0xNN> tokens for characters outside the vocabulary) and the decoder that turns
    "▁" into spaces and strips the first one."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = HFTokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_tokens([AddedToken("<tool>", special=False), AddedToken("<|im_end|>", special=True)])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tok(request: pytest.FixtureRequest) -> Iterator[Tokenizer]:
    with tempfile.TemporaryDirectory() as d:
        if request.param == "byte_level":
            write_tokenizer(d)
        else:
            byte_fallback_tokenizer(d)
        yield Tokenizer(d)


def no_stream(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> Tokenizer:
    """`tok` with no DecodeStream: its detokenizers run on the offsets alone."""
    monkeypatch.setattr(tok, "decode_stream", lambda context, skip: None)
    return tok


def stream_all(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """The deltas a stream shows, token by token, and the final one."""
    deltas = []
    for t in ids:
        if not det.stopped:
            det.add_one(t)
        deltas.append(det.take_delta())
    return [*deltas, det.take_delta(final=True)]


def vllm_text(tok: Tokenizer, prompt: list[int], out: list[int], skip: bool) -> str:
    """The text vLLM's FastIncrementalDetokenizer (vllm/v1/engine/detokenizer.py) gives
    `out` after `prompt`: a DecodeStream primed id by id with the prompt's shortest
    suffix of 4 to 23 ids whose text has no replacement character (else all of it),
    started afresh where it refuses a decode."""
    hf = tok._tok
    suffix = prompt
    if len(prompt) > 4:
        for n in range(4, min(len(prompt) + 1, 24)):
            if "\ufffd" not in hf.decode(prompt[-n:]):
                suffix = prompt[-n:]
                break
    stream = [DecodeStream(skip_special_tokens=skip)]

    def step(t: int) -> str | None:
        try:
            return stream[0].step(hf, t)
        except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception)
            stream[0] = DecodeStream(skip_special_tokens=skip)
            return stream[0].step(hf, t)

    for t in suffix:
        step(t)
    return "".join(step(t) or "" for t in out)


def test_text_continues_the_prompt_exactly(tok: Tokenizer) -> None:
    """Prompt and output cut anywhere in real text, through multi-byte characters: the
    streamed text is what decoding everything adds to the prompt's text, and for a
    prompt ending inside a character, that character whole and what follows it, as
    vLLM's fast detokenizer gives."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)  # characters are split
    inside = 0
    for cut in range(1, len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, prompt[-PROMPT_TAIL:], skip_special_tokens=skip)
            text = "".join(stream_all(det, out))
            assert text == vllm_text(tok, prompt, out, skip), (cut, skip)
            assert det._stream is not None
            whole, head = tok.decode(ids, skip), tok.decode(prompt, skip)
            if head.endswith("\ufffd"):  # the prompt ends inside a character
                inside += 1
                done = next(t for k in range(cut, -1, -1)  # its whole characters' text
                            if not (t := tok.decode(prompt[:k], skip)).endswith("\ufffd"))
                assert whole.startswith(done)
                assert text == whole[len(done):], (cut, skip)  # that character's text too
            else:
                assert whole.startswith(head)
                assert text == whole[len(head):], (cut, skip)
    assert inside > 0


def as_vllm(tok: Tokenizer, cases: list[tuple[list[int], list[int], bool]],
            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each (prompt, output, skip_special_tokens) case's text is vLLM's fast
    detokenizer's, on the stream and on the offsets alone."""
    wants = [vllm_text(tok, prompt, out, skip) for prompt, out, skip in cases]
    for tok_used in (tok, no_stream(tok, monkeypatch)):
        for (prompt, out, skip), want in zip(cases, wants, strict=True):
            det = IncrementalDetokenizer(tok_used, prompt[-PROMPT_TAIL:],
                                         skip_special_tokens=skip)
            assert "".join(stream_all(det, out)) == want, (prompt, out, skip)


def test_prompts_cut_between_characters_of_byte_runs(monkeypatch: pytest.MonkeyPatch,
                                                     ) -> None:
    """Byte-fallback tokens spell characters outside the vocabulary; a prompt of such
    characters, cut between two of them, is continued by the text decoding everything
    adds to it (a context beginning inside one of them would decode as replacement
    characters); cut inside one, as vLLM's fast detokenizer gives."""
    with tempfile.TemporaryDirectory() as d:
        byte_fallback_tokenizer(d)
        tok = Tokenizer(d)
    rng = random.Random(2)
    chars = "本中語日文字符😀🎉ñéü"
    cases, between = [], 0
    for _ in range(12):
        text = "".join(rng.choice(chars) if rng.random() < 0.8 else rng.choice([" ", "x ", " end"])
                       for _ in range(rng.randint(4, 14)))
        ids = tok.encode(text, add_special_tokens=False)
        whole = tok.decode(ids)
        for cut in range(1, len(ids)):
            prompt, out = ids[:cut], ids[cut:]
            head = tok.decode(prompt)
            if not head.endswith("\ufffd") and whole.startswith(head):
                between += 1
                assert vllm_text(tok, prompt, out, True) == whole[len(head):], (text, cut)
            cases.append((prompt, out, True))
    assert 100 < between < len(cases) < 1000
    as_vllm(tok, cases, monkeypatch)


def test_special_tokens_about_the_cut_as_vllm(tok: Tokenizer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Special tokens between characters, about a cut anywhere (after the start of a
    character too): the text is vLLM's fast detokenizer's, with them and without."""
    rng = random.Random(3)
    special = [t for t in range(tok.vocab_size) if tok.is_special(t)]
    ids = tok.encode(TEXT, add_special_tokens=False)
    cases: list[tuple[list[int], list[int], bool]] = []
    while len(cases) < 300:
        seq = list(ids)
        for _ in range(rng.randint(1, 4)):
            seq.insert(rng.randrange(len(seq)), rng.choice(special))
        if "\ufffd" in tok.decode(seq, False):  # one went inside a character
            continue
        cut = rng.randrange(1, len(seq))
        cases += [(seq[:cut], seq[cut:], skip) for skip in (True, False)]
    as_vllm(tok, cases, monkeypatch)


def test_random_ids_give_the_text_of_decoding_them_at_once(tok: Tokenizer) -> None:
    """Random outputs (special tokens, stray bytes, invalid UTF-8) from the start of a
    prompt: the text is the decode of the whole output, but for a character still
    incomplete at the end, which is never shown. (Byte-fallback tokens are left out:
    a run of them that is not UTF-8 decodes as one replacement character per byte,
    valid ones among them too, so their text depends on the bytes that follow.)"""
    rng = random.Random(0)
    special = [t for t in range(tok.vocab_size) if tok.is_special(t)]
    plain = [t for t in range(tok.vocab_size) if not str(tok.id_to_token(t)).startswith("<0x")]
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.choice(plain)
               for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
            text = "".join(stream_all(det, ids))
            whole = tok.decode(ids, skip)
            assert whole.startswith(text)
            assert set(whole[len(text):]) <= {"\ufffd"}, (ids, skip)


def test_stream_and_offsets_show_the_same_deltas(tok: Tokenizer,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Over random outputs weighted to special tokens, byte tokens and real text's ids,
    with stop strings (include_stop_str_in_output, min_tokens), the stream shows
    exactly what the offsets alone show, step by step: where the stream cannot start
    or refuses a decode, the request continues on the offsets from the same state."""
    rng = random.Random(1)
    vocab = tok.vocab_size
    special = [t for t in range(vocab) if tok.is_special(t)]
    partial = [t for t in range(vocab) if tok.decode([t], False).endswith("\ufffd")]
    text_ids = tok.encode(TEXT, add_special_tokens=False)

    def draw() -> int:
        r = rng.random()
        pool = special if r < 0.15 else partial if r < 0.35 else text_ids if r < 0.6 \
            else range(vocab)
        return rng.choice(pool)

    cases = []
    for _ in range(600):
        tail = [draw() for _ in range(rng.choice([0, 1, 3, 6]))]
        args = (rng.choice([(), ("e",), ("th", "ab"), ("中文",)]), rng.random() < 0.5,
                rng.random() < 0.5, rng.choice([0, 0, 3]))
        cases.append((tail, [draw() for _ in range(rng.randint(1, 40))], args))
    streamed, ended_on = [], {"start": 0, "offsets": 0}
    for tail, ids, args in cases:
        det = IncrementalDetokenizer(tok, tail, *args)
        ended_on["start"] += det._stream is None
        streamed.append((stream_all(det, ids), det.text, det.stopped, det.stop_str))
        ended_on["offsets"] += det._stream is None
    offsets_tok = no_stream(tok, monkeypatch)
    for (tail, ids, args), want in zip(cases, streamed, strict=True):
        det = IncrementalDetokenizer(offsets_tok, tail, *args)
        assert (stream_all(det, ids), det.text, det.stopped, det.stop_str) == want, \
            (tail, ids, args)
    # The stream starts on every byte-level context (one ending inside a character
    # holds that character's ids unread after it). Byte-fallback contexts of byte
    # tokens from inside a character, all replacement characters, start on the
    # offsets, as do decodes the stream refuses, and (with the stream going back to
    # the offsets' state at their next text) most requests end streamed.
    if any(str(tok.id_to_token(t)).startswith("<0x") for t in range(vocab)):
        assert 0 < ended_on["offsets"] < ended_on["start"] < len(cases)
    else:
        assert ended_on["start"] == ended_on["offsets"] == 0
    assert any(s[2] for s in streamed) and not all(s[2] for s in streamed)


def test_a_refused_decode_continues_on_the_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Byte-fallback tokens of invalid UTF-8 re-decode earlier text as replacement
    characters, which DecodeStream refuses: the text is the offsets' and the stream
    takes over again from their state."""
    with tempfile.TemporaryDirectory() as d:
        byte_fallback_tokenizer(d)
        tok = Tokenizer(d)
    hf = tok._tok
    ids = [hf.token_to_id("<0x32>"), hf.token_to_id("<0xE4>"), hf.token_to_id("▁the"),
           *tok.encode("rest follows", add_special_tokens=False)]
    det = IncrementalDetokenizer(tok, [])
    det.add_one(ids[0])
    assert det.text == "2"
    det.add_one(ids[1])  # "2" and a lead byte: two replacement characters, held back
    first = det._stream
    det.add_one(ids[2])  # "\ufffd\ufffd the" does not begin with "2": refused
    assert det.text == "2\ufffd the"  # the offsets' text: what follows the first char
    assert det._stream is not None and det._stream is not first  # a new stream
    for t in ids[3:]:
        det.add_one(t)
    reference = IncrementalDetokenizer(no_stream(tok, monkeypatch), [])
    reference.add(ids)
    assert det.text == reference.text
    assert det.text.endswith(" the rest follows")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_late_in_a_long_output(tok: Tokenizer, include: bool) -> None:
    """A stop string spanning tokens, hundreds of pieces into the text (kept in pieces,
    joined along the way): the text ends at it (with it when included), no delta ever
    shows text past it, and every cumulative text is the streamed deltas so far."""
    body = TEXT * 8
    ids = tok.encode(body + " STOP marker 日本 " + TEXT, add_special_tokens=False)
    prompt, out = ids[:3], ids[3:]
    head = tok.decode(prompt)
    whole = tok.decode(ids)[len(head):]
    stop = "marker 日本"
    end = whole.index(stop) + (len(stop) if include else 0)
    det = IncrementalDetokenizer(tok, prompt, stop=("never there", stop), include_stop=include)
    deltas: list[str] = []
    for k, t in enumerate(out):
        if det.stopped:
            break
        det.add_one(t)
        deltas.append(det.take_delta())
        if k % 50 == 49:  # (reading the whole text joins its pieces)
            assert det.shown == "".join(deltas)
            assert whole[:end].startswith(det.shown)
    deltas.append(det.take_delta(final=True))
    assert det.stopped and det.stop_str == stop
    assert "".join(deltas) == det.text == det.shown == whole[:end]
    assert len(out) > 300  # many joins of the pieces before the stop
