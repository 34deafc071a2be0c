# %% [markdown]
# # Inspecting, comparing and drawing kvxfer plans
#
# A plan is a value: build it on a laptop for any runtime version, look at it, and compare it with another.
# The notebook `examples/inspect_plans.ipynb` and the script `examples/inspect_plans.py` hold the same cells;
# `python examples/sync_notebook.py` rebuilds the notebook from the script.

# %%
# IPython's magic that shows figures (the transfer maps) in a notebook; inspect_plans.py keeps it a comment
# %matplotlib inline
from kvxfer.planner import PlanOptions, Target, diff_plans, hip_version, plan_transfer, presets
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
# The transfer map shows what a plan does. The strips (one row per region) lay each region's copies end to end
# in plan order, one segment per range in alternating shades: a merged run is one long segment, a fragmented
# restore a row of thin stripes. Colour is the driver call; a black tick marks where a call starts inside a
# row. Beside them: how many ranges have each size, and one region's source block against destination block.
#
# One region first: 24 blocks in four interleaved runs, planned into calls of at most three ranges.

# %%
one = plan_transfer(presets.kv_layout(1, 64, 4096), presets.mapping("interleaved", 24, 64), rocm_716,
                    PlanOptions(max_descriptors=3))
print(one.explain())
transfer_map(one)

# %% [markdown]
# The 118-region restore from the top: 256 blocks per region in runs of 8, merged into 32 ranges per region,
# all in one call.

# %%
transfer_map(plan)

# %% [markdown]
# The same restore without merging: a range per block, 30208 in all, cut into 8 calls of at most 4096.

# %%
transfer_map(unmerged)
