#!/usr/bin/env python3
"""make_bpe_fixture.py: writes tests/fixtures/bpe/, the reference the C BPE tokenizer is checked
against (tests/test_bpe.c). Run once, by hand, when the fixture must change:

    pip install tiktoken tokenizers
    python3 tools/make_bpe_fixture.py            # writes tests/fixtures/bpe/

It trains a small byte-level BPE (about 3000 merges) on a generated, deterministic corpus of
prose, code, CJK, emoji, combining marks and numbers, then writes the same vocabulary twice:

  tiktoken.model        the tiktoken format ("base64(token bytes) rank" per line), with
  tokenizer_config.json  Kimi's special-token layout (added_tokens_decoder: ids after the ranks)
  tokenizer.json         the Hugging Face format (BPE model, Split + ByteLevel pre-tokenizer,
                         ignore_merges), saved by the `tokenizers` library itself
  tokenizer_gpt2.json    the same vocabulary in GPT-2's form: ByteLevel's own regex, merges as
                         "a b" strings, ignore_merges off, only the named specials

and cases.txt: for a varied test corpus, the exact ids the `tiktoken` library and the
`tokenizers` library give. The C test needs no Python: it reads these files.

cases.txt, one record per case (text as hex so invalid UTF-8 survives):
    case NAME
    text HEX
    mode ordinary|special      (special: special tokens in the text are matched)
    tiktoken ID ID ...
    hf ID ID ... | hf -        ("-": the case has invalid UTF-8, which the HF library cannot take)
    gpt2 ID ID ... | gpt2 -    (tokenizer_gpt2.json)
    end
"""
import base64
import collections
import json
import os
import random
import sys

import regex
import tiktoken
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# Kimi's pre-tokenizer pattern (tokenization_kimi.py of the Kimi-Linear / Kimi-K2 repos). The C
# module carries the same string as MTRL_BPE_PATTERN_KIMI; tests/test_bpe.c checks both agree.
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

N_MERGES = 3000
# Cases whose pieces are made whole tokens (see main); the others exercise the merges.
PIECE_CASES = {"cjk", "contractions", "cjk_punct", "whitespace", "unicode_space", "numbers", "mixed_scripts",
               "case_mix", "punct_runs", "newlines"}
N_RESERVED = 256  # Kimi reserves 256 special ids after the ranks
NAMED_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                  "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>",
                  "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                  "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]

WORDS = ("the of and to in is that for it as with was on be by this are from or have an "
         "not they which one you were all we her she there would their will when who him been "
         "has more if no out so said what up its about into than them can only other new some "
         "could time these two may then do first any my now such like our over man me even most "
         "made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still "
         "tokenizer merge rank byte encode decode learner actor trajectory gradient kernel").split()
CODE = [
    "def f(x):\n    return x * 2 + 1\n",
    "for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}\n",
    "if __name__ == \"__main__\":\n    main()\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }\n",
    "    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;\n",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}\n",
    "x = np.zeros((3, 4), dtype=np.float32)  # comment\n",
]
CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坏兴急"
KANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワヲンー"
HANGUL = "한국어텍스트시험합니다오토플레이기능을활성화했습니다"
OTHER = ["Ελληνικά κείμενα", "Русский текст и слова", "العربية نص", "हिन्दी पाठ नमस्ते",
         "café naïve résumé Straße", "e\u0301 a\u0308 n\u0303 combining", "🙂🚀👍🏽 emoji ✨🔥",
         "ﬁ ﬂ ǅ Ǆ ǆ", "１２３ ４５６ ٣٤٥ ⅻ", "\u00a0\u2009\u3000 spaces"]


def gen_corpus(rng):
    parts = []
    for _ in range(2500):
        k = rng.random()
        if k < 0.45:
            n = rng.randint(3, 14)
            s = " ".join(rng.choice(WORDS) for _ in range(n))
            if rng.random() < 0.3:
                s = s.capitalize()
            s += rng.choice([". ", ", ", "? ", "! ", "\n", "\n\n", "'s ", " don't "])
            parts.append(s)
        elif k < 0.65:
            parts.append(rng.choice(CODE))
        elif k < 0.78:
            parts.append("".join(rng.choice(CJK) for _ in range(rng.randint(2, 12)))
                         + rng.choice(["，", "。", "、", "\n"]))
        elif k < 0.84:
            parts.append("".join(rng.choice(KANA) for _ in range(rng.randint(2, 8))) + "。")
        elif k < 0.87:
            parts.append("".join(rng.choice(HANGUL) for _ in range(rng.randint(2, 6))) + " ")
        elif k < 0.94:
            parts.append(rng.choice(OTHER) + " ")
        else:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))) + rng.choice([" ", ".", ", ", "\n"]))
    return "".join(parts)


def train_bpe(text, n_merges):
    """A plain byte-level BPE trainer: the most frequent adjacent pair of the pre-split pieces
    becomes the next rank (ties broken by the pair's bytes, so the result is deterministic)."""
    counts = collections.Counter(regex.findall(KIMI_PAT, text, flags=regex.V1))
    words = [[bytes([b]) for b in w.encode("utf-8")] for w in counts]
    freq = [counts[w] for w in counts]
    ranks = {bytes([i]): i for i in range(256)}
    pairs = collections.Counter()
    where = collections.defaultdict(set)
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pairs[(a, b)] += freq[i]
            where[(a, b)].add(i)
    for _ in range(n_merges):
        if not pairs:
            break
        (a, b), c = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if c <= 0:
            break
        new = a + b
        if new not in ranks:
            ranks[new] = len(ranks)
        for i in list(where[(a, b)]):
            w = words[i]
            for x, y in zip(w, w[1:]):
                pairs[(x, y)] -= freq[i]
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(new)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for x, y in zip(out, out[1:]):
                pairs[(x, y)] += freq[i]
                where[(x, y)].add(i)
        for p in [p for p, v in pairs.items() if v <= 0]:
            del pairs[p]
            where.pop(p, None)
    return ranks


def bytes_to_unicode():
    """GPT-2's byte <-> printable character table used by the HF ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def hf_merges(ranks):
    """tiktoken merges any adjacent pair whose concatenation has a rank (priority: that rank);
    HF merges listed pairs. Listing every split of every token, by the rank of the result, makes
    the HF model merge exactly as tiktoken does (the usual tiktoken -> HF conversion)."""
    merges = []
    for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        splits = [(tok[:k], tok[k:]) for k in range(1, len(tok))
                  if tok[:k] in ranks and tok[k:] in ranks and ranks[tok[:k]] < r and ranks[tok[k:]] < r]
        splits.sort(key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))
        merges.extend(splits)
    return merges


def test_texts_for_training():
    """The valid test texts join the training corpus (a few times), so the vocabulary has merges
    across their piece boundaries' neighbourhoods: ids then change when a piece boundary moves."""
    out = []
    for _, data, _ in test_cases():
        try:
            out.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            pass
    return "".join(out) * 20


def test_cases():
    """(name, text as bytes, mode)."""
    s = lambda t: t.encode("utf-8")
    cases = [
        ("ascii", s("Hello, world! This is a test of the tokenizer's merges."), "ordinary"),
        ("contractions", s("I'm sure they'll say we'd've done it; it's HE'S, You'RE, it'ſ"), "ordinary"),
        ("code_py", s("def fibonacci(n):\n    return n if n < 2 else fibonacci(n-1) + fibonacci(n-2)\n"), "ordinary"),
        ("code_c", s("int main(void) {\n\tfor (int i = 0; i < 10; i++) printf(\"%d\\n\", i);\n}\n"), "ordinary"),
        ("json", s("{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}\r\n"), "ordinary"),
        ("cjk", s("中文字符和日本語のテキスト、そして한국어。大家好，我是一个模型。Hello世界 テスト漢字 ABC漢字def ǅ中"), "ordinary"),
        ("cjk_punct", s("「引用」『二重』〜、。，！？（全角）々〆〇"), "ordinary"),
        ("han_ext", s("㐀㐁 𠀀𠀁 龘"), "ordinary"),
        ("emoji", s("emoji 🙂🚀 and 👍🏽 family 👨‍👩‍👧 flags 🇯🇵 ✨"), "ordinary"),
        ("combining", s("e\u0301 a\u0308 n\u0303 \u0301\u0302x Z\u0351\u0337alg\u0338o"), "ordinary"),
        ("whitespace", s("  leading and   multiple   spaces\tand\ttabs\n\n\nand blank lines  \n \n\t\n   "), "ordinary"),
        ("unicode_space", s("a\u00a0b\u2009c\u3000d\u2028e\u0085f\u180eg\u200bh \u000b\u000c\u001c x\u180e\u180e  y\u0085\u0085  z"), "ordinary"),
        ("numbers", s("Numbers 1234567890 and 3.14159 and 1,000,000 and 0xDEADBEEF ١٢٣٤ １２３４ Ⅻ"), "ordinary"),
        ("mixed_scripts", s("Ελληνικά Русский العربية हिन्दी café naïve Straße ǅemal ﬁre"), "ordinary"),
        ("case_mix", s("CamelCase snake_case SCREAMING_CASE iPhone McDONALD's ÀÉÎõü"), "ordinary"),
        ("punct_runs", s("!!!??? ... --- *** ### @@@ /// \\\\ ||| &&& ~~~ ```\n```"), "ordinary"),
        ("empty", b"", "ordinary"),
        ("one_byte", b"a", "ordinary"),
        ("newlines", s("\n\n\r\n\r\r\n \n"), "ordinary"),
        ("long_word", s("supercalifragilisticexpialidocious" * 4), "ordinary"),
        ("long_space", s(" " * 70 + "x" + "\t" * 9), "ordinary"),
        ("specials", s("[BOS]<|im_user|>user<|im_middle|>What is 3+4?<|im_end|><|im_assistant|>"
                       "<|tool_calls_section_begin|><|tool_call_begin|>calc<|tool_call_argument_begin|>{\"x\":7}"
                       "<|tool_call_end|><|tool_calls_section_end|>[EOS]"), "special"),
        ("specials_as_text", s("[BOS]<|im_user|>hi<|im_end|>[EOS]"), "ordinary"),
        ("reserved_special", s("a<|reserved_token_%d|>b" % 0), "special"),  # id patched below
        ("special_adjacent", s("<|im_end|><|im_end|>x<|im_end|>"), "special"),
        ("special_partial", s("<|im_en <|im_end| [BOS [EOS]"), "special"),
        # invalid UTF-8: each maximal run of bytes that is not valid UTF-8 is one BPE piece
        ("invalid_lone", b"abc \xff def \xfe\xfd ghi", "ordinary"),
        ("invalid_truncated", b"\xe4\xb8 x \xe4\xb8\xad\xe6 end \xf0\x9f\x99", "ordinary"),
        ("invalid_surrogate", b"a\xed\xa0\x80b \xc0\x80 \xf4\x90\x80\x80 \xc3", "ordinary"),
        ("invalid_mixed_special", b"\xff[BOS]\xfe <|im_end|>\x80", "special"),
    ]
    return cases


def split_invalid(data):
    """Maximal valid UTF-8 runs and maximal invalid runs, in order: (is_valid, bytes)."""
    out = []
    dec = data.decode("utf-8", "surrogateescape")
    cur, cur_valid = [], None
    for ch in dec:
        valid = not (0xDC80 <= ord(ch) <= 0xDCFF)
        if cur_valid is not None and valid != cur_valid:
            out.append((cur_valid, "".join(cur).encode("utf-8", "surrogateescape")))
            cur = []
        cur.append(ch)
        cur_valid = valid
    if cur:
        out.append((cur_valid, "".join(cur).encode("utf-8", "surrogateescape")))
    return out


def tiktoken_ids(enc, specials, data, mode):
    ids = []
    for valid, run in split_invalid(data):
        if not valid:
            ids.extend(enc._encode_single_piece(run))
        elif mode == "special":
            ids.extend(enc.encode(run.decode("utf-8"), allowed_special="all"))
        else:
            ids.extend(enc.encode_ordinary(run.decode("utf-8")))
    return ids


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out_dir = os.path.join(here, "..", "tests", "fixtures", "bpe")
    if len(sys.argv) > 1:
        out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(22)
    ranks = train_bpe(gen_corpus(rng) + test_texts_for_training(), N_MERGES)
    # The pieces of a few cases, and each two neighbouring pieces joined, become whole tokens
    # (after the merges), so their ids show every piece boundary: a regex that moves one gives
    # other ids. The pieces are the tokenizers library's; tiktoken agreeing on the ids (checked
    # below) confirms them.
    splitter = pre_tokenizers.Split(Regex(KIMI_PAT), behavior="isolated")
    for name, data, _ in test_cases():
        if name in PIECE_CASES:
            pieces = [p.encode("utf-8") for p, _ in splitter.pre_tokenize_str(data.decode("utf-8"))]
            for tok in pieces + [a + b for a, b in zip(pieces, pieces[1:])]:
                if tok not in ranks:
                    ranks[tok] = len(ranks)
    n_base = len(ranks)
    specials = {}
    for i in range(N_RESERVED):
        name = NAMED_SPECIALS[i] if i < len(NAMED_SPECIALS) else "<|reserved_token_%d|>" % (n_base + i)
        specials[name] = n_base + i
    enc = tiktoken.Encoding("mtrl-fixture", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)

    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write("%s %d\n" % (base64.b64encode(tok).decode(), r))
    config = {"added_tokens_decoder": {str(n_base + i): {"content": name, "lstrip": False, "normalized": False,
                                                         "rstrip": False, "single_word": False, "special": True}
                                       for i, name in enumerate(NAMED_SPECIALS)},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "model_max_length": 1048576,
              "tokenizer_class": "TikTokenTokenizer"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
        f.write("\n")

    b2u = bytes_to_unicode()
    mapped = lambda b: "".join(b2u[x] for x in b)
    vocab = {mapped(tok): r for tok, r in ranks.items()}
    merges = [(mapped(a), mapped(b)) for a, b in hf_merges(ranks)]
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False)
                           for name, _ in sorted(specials.items(), key=lambda kv: kv[1])])
    hf.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    hf = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))

    # A second tokenizer.json in GPT-2's form: the ByteLevel pre-tokenizer's own regex, merges as
    # "a b" strings (the older layout), ignore_merges off (pure merge priorities).
    gpt2 = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.add_special_tokens([AddedToken(name, special=True, normalized=False)
                             for name, _ in sorted(specials.items(), key=lambda kv: kv[1])][:len(NAMED_SPECIALS)])
    gpt2_path = os.path.join(out_dir, "tokenizer_gpt2.json")
    gpt2.save(gpt2_path, pretty=False)
    with open(gpt2_path) as f:
        doc = json.load(f)
    doc["model"]["merges"] = [" ".join(m) for m in doc["model"]["merges"]]
    with open(gpt2_path, "w") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
    gpt2 = Tokenizer.from_file(gpt2_path)

    n_diff = 0
    with open(os.path.join(out_dir, "cases.txt"), "w") as f:
        f.write("# made by tools/make_bpe_fixture.py with tiktoken %s; do not edit\n" % tiktoken.__version__)
        for name, data, mode in test_cases():
            if name == "reserved_special":
                data = ("a<|reserved_token_%d|>b" % (n_base + 100)).encode()
            tk = tiktoken_ids(enc, specials, data, mode)
            assert enc.decode_bytes(tk) == data, name
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            hf_ids = gpt2_ids = None
            if text is not None:
                hf.encode_special_tokens = mode != "special"
                hf_ids = hf.encode(text, add_special_tokens=False).ids
                gpt2.encode_special_tokens = mode != "special"
                gpt2_ids = gpt2.encode(text, add_special_tokens=False).ids
                if hf_ids != tk:
                    n_diff += 1
                    print("note: %s: tokenizers and tiktoken disagree" % name, file=sys.stderr)
            f.write("case %s\ntext %s\nmode %s\n" % (name, data.hex(), mode))
            f.write("tiktoken %s\n" % " ".join(map(str, tk)))
            f.write("hf %s\n" % (" ".join(map(str, hf_ids)) if hf_ids is not None else "-"))
            f.write("gpt2 %s\n" % (" ".join(map(str, gpt2_ids)) if gpt2_ids is not None else "-"))
            f.write("end\n")
    size = sum(os.path.getsize(os.path.join(out_dir, p)) for p in os.listdir(out_dir))
    print("wrote %s: %d ranks, %d merges, %d specials, %d bytes; %d cases where the libraries disagree"
          % (out_dir, n_base, len(merges), len(specials), size, n_diff))


if __name__ == "__main__":
    main()
