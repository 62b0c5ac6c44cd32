"""fsdpp's layers, as data: read by Bazel (tools/layering/BUILD) and by the
layering check (layering_check.py, run by layering_test.sh), and drawn in
docs/ARCHITECTURE.md.

FLOORS lists the floors from the bottom up; each floor is a list of
packages. A target may depend only on targets of its own package or of a
package on a lower floor: never up, never sideways to another package of its
own floor. Test targets and test helpers follow the same rule, so no two
packages depend on each other through their tests. External repositories
(@absl, @gloo, ...), Bazel's //conditions and the root package (build
settings) are below every floor.

FORBIDDEN lists pairs (user, used) that must never meet even though the
floors would allow it: a package and everything below it in the path
(`models` covers `models/...`) unless the exception is named in
FORBIDDEN_EXCEPT.
"""

FLOORS = [
    ["third_party"],
    ["core"],
    ["formats"],
    ["comm"],
    ["runtime"],
    ["mesh"],
    ["tensor"],
    ["formats/safetensors"],
    ["nn"],
    ["fsdp"],
    ["parallel"],
    ["optim", "checkpoint"],
    # A training run's state: FSDP's masters and AdamW's, as one checkpoint.
    ["checkpoint/training"],
    ["models"],
    # The training step (the parity harness runs it too).
    ["recipe/step"],
    ["models/testing"],
    ["models/parallelize"],
    ["models/gpt2", "models/llama"],
    ["recipe"],
    ["plan"],
    ["trainer/data", "tools/plot"],
    [
        "trainer",
        "tests",
        "tools/bench",
        "tools/ckpt",
        "tools/launch",
    ],
    # The planner's command line reads trainer configs; the format check
    # reads files only.
    ["tools/plan", "tools/lint"],
    # The check itself reads every package's dependencies file.
    ["tools/layering"],
]

# Models are single-device code: only their parallelize plans meet FSDP, and
# their weights reach files through formats/, not checkpoint/.
FORBIDDEN = [
    ["models", "fsdp"],
    ["models", "optim"],
    ["models", "checkpoint"],
    ["models", "comm"],
    ["models", "mesh"],
    # nn layers are single-device too.
    ["nn", "comm"],
    ["nn", "mesh"],
    # The data pipeline knows tokens and files, not tensors or ranks' groups.
    ["trainer/data", "tensor"],
    ["trainer/data", "comm"],
]

# (user, used) pairs that FORBIDDEN would catch but the design allows.
FORBIDDEN_EXCEPT = [
    # The plans are where models meet FSDP and tensor parallelism (whose
    # mesh axis they name).
    ["models/parallelize", "fsdp"],
    ["models/parallelize", "mesh"],
    ["models/gpt2", "fsdp"],
    ["models/llama", "fsdp"],
    # The parity harness trains a model under FSDP / DDP layouts with AdamW.
    ["models/testing", "fsdp"],
    ["models/testing", "optim"],
    ["models/testing", "mesh"],
    ["models/testing", "comm"],
    ["models/gpt2", "mesh"],
    ["models/llama", "mesh"],
]
