"""bench/cpu_profile.py's sample classes, on `perf script` text as perf 6.1 writes it: each
sample goes to the first class a frame names from the leaf up, other processes and idle
apart (the table in docs/benchmarks.md rests on these)."""

from __future__ import annotations

import importlib.util
from collections import Counter
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("cpu_profile", ROOT / "bench" / "cpu_profile.py")
assert _spec is not None and _spec.loader is not None
cpu_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_profile)

K = "[kernel.kallsyms]"
SCRIPT = f"""\
python 500/500
\t           1f7da [unknown] (/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0)
\t               0 [unknown] ([unknown])

python 500/507
\t           abfd9 ggml_vec_dot_f32 (/venv/lib/python3.11/site-packages/llama_cpp/lib/libggml-cpu.so.0)

python 500/503
\tffffffff82250979 native_write_msr ({K})
\tffffffff813b459b smp_call_function_many_cond ({K})
\tffffffff81311696 flush_tlb_mm_range ({K})
\tffffffff81311697 do_mremap ({K})
\tffffffff81311698 __do_sys_mremap ({K})
\t           12345 __GI___mremap (/usr/lib/x86_64-linux-gnu/libc.so.6)

python 500/504
\tffffffff82250979 unpin_user_folio ({K})
\tffffffff82250970 handle_softirqs ({K})
\tffffffff82250971 __irq_exit_rcu ({K})
\tffffffff82250972 common_interrupt ({K})
\tffffffff82250973 bio_iov_iter_get_pages ({K})
\tffffffff82250974 do_preadv ({K})

python 500/505
\tffffffff82250979 gup_fast_fallback ({K})
\tffffffff82250974 do_preadv ({K})

python 500/500
\t           fb699 _PyEval_EvalFrameDefault (/py/lib/libpython3.11.so.1.0)

python 500/500
\t            2a10 matvec_bf16.avx512f (/repo/bmoe/native/evalcb.cpython-311-x86_64-linux-gnu.so)

python 500/500
\tffffffff82250979 clear_page_erms ({K})

kworker/1:1H-kb    56/56
\tffffffff82250979 blk_mq_run_work_fn ({K})

swapper     0/0
\tffffffff82250979 pv_native_safe_halt ({K})

python 777/777
\t           fb699 _PyEval_EvalFrameDefault (/py/lib/libpython3.11.so.1.0)
"""


def test_samples_go_to_the_class_their_leaf_most_named_frame_says() -> None:
    counts = cpu_profile.parse(SCRIPT, worker=500)
    assert counts == {
        "OpenMP waiting": 1, "llama.cpp compute": 1, "page moves (mremap, TLB flush)": 1,
        "interrupts (read completions)": 1,      # an interrupt taken inside a read
        "direct reads (preadv, AIO)": 1, "Python and numpy": 1, "other kernel": 1,
        "bmoe's C (callback, guesses, victims)": 1,
        "other processes": 2,                    # a kworker, and another python process
        "idle": 1,
    }
    assert set(counts) <= set(cpu_profile.CLASSES)


def test_samples_split_by_thread_of_the_worker_and_threads_get_roles() -> None:
    threads: dict[int, Counter[str]] = {}
    cpu_profile.parse(SCRIPT, worker=500, threads=threads)
    assert set(threads) == {500, 503, 504, 505, 507}            # only the worker's threads
    assert threads[503] == {"page moves (mremap, TLB flush)": 1}
    assert sum(threads[500].values()) == 4                      # its four samples
    role = cpu_profile.thread_role
    assert role({"direct reads (preadv, AIO)": 2.0, "page moves (mremap, TLB flush)": 1.0,
                 "Python and numpy": 0.5}) == "read lane"
    assert role({"llama.cpp compute": 25.0, "Python and numpy": 7.9,
                 "bmoe's C (callback, guesses, victims)": 1.0}) == "engine thread"
    assert role({"llama.cpp compute": 25.0, "OpenMP waiting": 26.0,
                 "interrupts (read completions)": 1.5}) == "compute thread (OpenMP)"
    assert role({"thread wake-ups (futex, scheduler)": 1.0}) == "other thread"
