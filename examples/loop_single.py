from rtxmpi.data import BatchSampler, load_corpus
from rtxmpi.nn import GPT, AdamW, GPTConfig, decay_mask

corpus = load_corpus()                                   # the stdlib's source, as bytes
model = GPT(GPTConfig.named("tiny", seq_len=64), seed=0)
opt = AdamW(model.flat_data, lr=1e-3, decay_mask=decay_mask(model.params))
sampler = BatchSampler(corpus.train, 64, global_batch=16, seed=0)
for step in range(1, 21):
    x, y = sampler.next_batch()
    loss, cache = model.forward(x, y)
    model.backward(cache)
    opt.step(model.flat_grad)
    model.zero_grad()
    print(f"step {step} loss {loss:.3f}")
