"""Benchmarks: Spec-Bench runs (`outpace bench`) and the engines compared in benchmarks/.

dataset (Spec-Bench records), specbench (the run: speculative and plain, alternating), summary
(per-category figures, markdown), margin (where greedy outputs part), chart, peers (outpace,
transformers and llama.cpp behind one generate call), models (GGUF lookup, random 8B shape).
"""
