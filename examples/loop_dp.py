import rtxmpi                                            # first: each rank's BLAS threads
from rtxmpi.data import BatchSampler, load_corpus
from rtxmpi.nn import GPT, AdamW, GPTConfig, decay_mask
from rtxmpi.parallel.data import DataParallel

world = rtxmpi.init()
corpus = load_corpus()                                   # the stdlib's source, as bytes
model = GPT(GPTConfig.named("tiny", seq_len=64), seed=0)
ddp = DataParallel(model, world)
opt = AdamW(model.flat_data, lr=1e-3, decay_mask=decay_mask(model.params))
sampler = BatchSampler(corpus.train, 64, global_batch=16, seed=0, dp_rank=world.rank, dp_size=world.world_size)
for step in range(1, 21):
    x, y = sampler.next_batch()
    loss, cache = ddp.forward(x, y)
    ddp.backward(cache)
    ddp.step(opt)
    print(f"step {step} loss {loss:.3f} (rank 0's slice)") if world.rank == 0 else None
