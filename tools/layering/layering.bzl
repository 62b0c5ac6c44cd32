"""record_dependencies(): the last line of every package's BUILD file.

It writes `:dependencies`, a text file with one line per (rule, label) that a
rule of this package refers to in any attribute (deps, data, srcs, tools,
select() branches included), as Bazel sees the rules at loading time. The
layering test (//tools/layering:layering_test) reads these files and checks
them against floors.bzl. Rules declared after the call are not seen, so it
must stay the last statement of the file.
"""

def _labels(value):
    """Every absolute label ("//..." or "@...") inside an attribute value."""
    text = str(value)
    out = []
    for quote in ['"', "'"]:
        parts = text.split(quote)
        for i in range(1, len(parts), 2):
            s = parts[i]
            if s.startswith("//") or s.startswith("@"):
                out.append(s)
    return out

def record_dependencies():
    lines = []
    for name, rule in sorted(native.existing_rules().items()):
        if name == "dependencies":
            continue
        for attr in sorted(rule.keys()):
            if attr in ["name", "generator_name", "generator_function", "generator_location", "visibility"]:
                continue
            for label in _labels(rule[attr]):
                lines.append("%s %s %s %s" % (name, rule["kind"], attr, label))
    native.genrule(
        name = "dependencies",
        outs = ["dependencies.txt"],
        cmd = "cat > $@ <<'FSDPP_EOF'\n" + "\n".join(lines) + "\nFSDPP_EOF",
        visibility = ["//tools/layering:__pkg__"],
        testonly = True,
    )
