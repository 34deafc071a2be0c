# %% [markdown]
# # Inspecting, comparing and drawing kvxfer plans
#
# A plan is a value: build it on a laptop for any runtime version, look at it, and compare it with another.
# This is the plain-script twin of `inspect_plans.ipynb` (same cells; `python examples/sync_notebook.py`
# rebuilds the notebook from this file).

# %%
import matplotlib.pyplot as plt

from kvxfer.planner import PlanOptions, Target, hip_version, plan_transfer, presets
from kvxfer.planner.diff import diff_plans
from kvxfer.planner.render import stats_frame
from kvxfer.planner.viz import transfer_map

layout = presets.kv_layout(118, 512)  # 118 KV tensors (MiniMax-M3 at TP4), 512 pages of 32 KiB each
mapping = presets.mapping("runs8", 256, 512)  # restore 256 blocks that sit in runs of 8
rocm_716 = Target(platform="rocm", runtime_version=hip_version(7, 16))
plan = plan_transfer(layout, mapping, rocm_716)
print(repr(plan))
plan  # a notebook renders the HTML view here

# %% [markdown]
# `explain()` is the fixed-width text that tests pin; long plans are elided in the middle.

# %%
print(plan.explain(max_rows=8))

# %% [markdown]
# Statistics come as a dict (`plan.stats()`) or as pandas frames.

# %%
print(plan.stats()["run_length_histogram"])
stats_frame(plan, "region").head()

# %% [markdown]
# ROCm 7.2 against 7.16: the same ranges, but 7.16 passes attributes and asks for the copy engines.

# %%
rocm_72 = Target(platform="rocm", runtime_version=hip_version(7, 2))
old = plan_transfer(layout, mapping, rocm_72)
d = diff_plans(old, plan)
print(d.summary)
d

# %% [markdown]
# Two option sets: without merging the plan has 8x the descriptors in 8 calls, yet moves the same bytes.

# %%
unmerged = plan_transfer(layout, mapping, rocm_716, PlanOptions(coalesce=False, max_descriptors=4096))
d = diff_plans(plan, unmerged)
print(d.text(max_rows=6))
assert d.equivalent and not d.identical

# %% [markdown]
# The transfer map: source blocks across, destination blocks up; each band is one range, coloured by region.
# A small layout shows the shape (four interleaved runs, calls of six ranges).

# %%
small = plan_transfer(presets.kv_layout(4, 64, 4096), presets.mapping("interleaved", 24, 64), rocm_716,
                      PlanOptions(max_descriptors=6))
fig, ax = plt.subplots(figsize=(7, 6), layout="constrained")
transfer_map(small, ax=ax)
print(small.explain(max_rows=4))
