"""vLLM's check_logprobs_close rule: greedy tokens agree until the first divergence, where each side's
token must be in the other side's top-k."""
import torch


def greedy_with_topk(model, input_ids, new_tokens, **kwargs):
    out = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[:, input_ids.shape[1]:]
    return tokens, torch.stack(out.logits, 1)  # (batch, steps), (batch, steps, vocab)


def check_topk_gate(ref_tokens, ref_logits, out_tokens, out_logits, k=5, label=""):
    """Returns the first divergence step per row (None if identical); asserts the top-k rule there."""
    firsts = []
    for row in range(ref_tokens.shape[0]):
        first = None
        for step in range(min(ref_tokens.shape[1], out_tokens.shape[1])):
            a, b = int(ref_tokens[row, step]), int(out_tokens[row, step])
            if a != b:
                ref_top = ref_logits[row, step].topk(k).indices.tolist()
                out_top = out_logits[row, step].topk(k).indices.tolist()
                assert b in ref_top and a in out_top, (
                    f"{label} row {row}: first divergence at step {step}: reference {a} (top-{k} {ref_top}), "
                    f"patched {b} (top-{k} {out_top})")
                first = step
                break
        firsts.append(first)
    return firsts
