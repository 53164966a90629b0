import asyncio, json, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch, transformers, yaml
sys.path.insert(0, "benchmarks")
import serve as sb

work = Path("/tmp/diag2"); work.mkdir(exist_ok=True)
base = work / "base"
cfg = sb.base_config(type("A", (), {"smoke": False})())
cfg.num_hidden_layers = 4
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    m = transformers.LlamaForCausalLM(cfg)
torch.set_default_dtype(torch.float32)
m.generation_config = transformers.GenerationConfig(bos_token_id=1, pad_token_id=0, eos_token_id=None)
m.save_pretrained(base); sb.word_tokenizer(cfg.vocab_size, 131072).save_pretrained(base); del m
for method in ("cca", "dca"):
    out = work / method
    if not out.exists():
        sb.export(base, method, out, work)
    raw = json.loads((out / "config.json").read_text())
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    cls = get_class_from_dynamic_module(raw["auto_map"]["AutoModelForCausalLM"], str(out))
    setattr(transformers, raw["architectures"][0], cls)
    model = cls.from_pretrained(out, attn_implementation=None, dtype="auto", device_map="cuda:0", trust_remote_code=True)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    print(method, type(model).__mro__[:3], model.dtype, model.training, model.generation_config)
    seen = []
    def hook(mod, args, kwargs):
        seen.append((sorted(kwargs), type(kwargs.get("past_key_values")).__name__))
        hook.cache = kwargs.get("past_key_values")
    model.register_forward_pre_hook(hook, with_kwargs=True)
    from transformers.cli.serving.utils import GenerateManager
    import copy
    gc = copy.deepcopy(model.generation_config); gc.max_new_tokens = 64; gc.do_sample = False
    inputs = tok(sb.prompt(8192, cfg.vocab_size, 1), return_tensors="pt").to(model.device)
    async def go():
        mgr = GenerateManager()
        queue, streamer = mgr.generate_streaming(model, tok, inputs, gc, request_id="x")
        t = []
        while True:
            x = await queue.get()
            if x is None: break
            t.append(time.perf_counter())
        return t
    for rep in range(2):
        seen.clear()
        t = asyncio.run(go())
        g = getattr(hook.cache, "decode_graphs", None)
        print(method, rep, f"{(t[-1]-t[5])/(len(t)-6)*1e3:.2f} ms/token", "replays", getattr(g, "replays", None),
              "failures", getattr(g, "failures", None), "model failure", getattr(model, "_graph_failure", None))
        print("  kwargs of step 3:", seen[3] if len(seen) > 3 else seen)
    del model; torch.cuda.empty_cache()
