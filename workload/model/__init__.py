"""The network and its math: what one step computes, and how its arrays are laid out over the mesh.

decoder       the decoder-only LM (Flax NNX): RMSNorm, RoPE, attention, SwiGLU or MoE MLP, remat, fp8
attention     causal grouped-query attention: XLA reference and Splash, load-balanced context-parallel order
moe           mixture of experts: top-k router, dropless grouped-matmul experts (fp8 through qwix), expert
              parallelism
chunked       work split into slices with a backward pass that recomputes one slice at a time (the sliced MLP)
loss          the LM head and cross entropy, tiled over sequence and vocabulary, with a hand-written backward
layer_gather  one layer's weights gathered in one collective of bf16 bits per pass, on the CPU
sharding      mesh construction, logical-axis rules, parameter-sharding and state-memory checks
"""
