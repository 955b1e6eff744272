#!/usr/bin/env bash
# The -h / --help of every script under scripts/: prints the script's header comment (what it does, the variables
# and arguments it reads with their defaults, examples) and the headers of the shared files it builds on (a
# scripts/lib/*.sh it sources, a script it hands over to with `exec bash`), then exits 0. It only reads files:
# nothing is sourced, started, installed or written, so a user can ask any script what it does before running it.
#
#   bash scripts/lib/help.sh scripts/run_babyai_grpo_train.sh     (what `... run_babyai_grpo_train.sh -h` runs)
#
# Each script hands over to it first thing, before its own settings and anything it sources, with the line
#   case " $* " in *" -h "* | *" --help "*) exec bash ".../lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail

LIB="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SCRIPTS="$(dirname "$LIB")"
ROOT="$(dirname "$SCRIPTS")"

# The comment block at the top of a file (after the shebang), without `#SBATCH` and `# shellcheck` directives.
header() {
    awk 'NR == 1 && /^#!/ { next }
         /^#SBATCH/ || /^# shellcheck/ { next }
         /^#/ { sub(/^# ?/, ""); print; next }
         { exit }' "$1"
}

# The files a script builds on for its settings: what it sources or exec's (the line names the file literally) and
# its header refers to (ray_cluster_head.sh sources common.sh for two helpers, and lists its own settings).
related() {
    local file="$1" dir name text
    dir="$(dirname "$file")"
    text="$(header "$file")"
    grep -E '^[[:space:]]*(source|exec bash)[[:space:]]' "$file" | grep -oE '(lib/)?[A-Za-z0-9_]+\.sh' |
        while read -r name; do
            [[ "$text" == *"$(basename "$name")"* ]] || continue
            case "$name" in
                lib/*) echo "$SCRIPTS/$name" ;;
                *) echo "$dir/$name" ;;
            esac
        done
}

if [ $# -eq 0 ]; then
    header "${BASH_SOURCE[0]}"
    exit 0
fi
file="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
echo "usage: bash ${file#"$ROOT"/} [ARGUMENTS]   (-h or --help: this text; nothing is run)"
echo
header "$file"
# breadth-first over what it builds on (tmux.sh itself builds on common.sh), each file once
queue=("$file") seen=" $file "
while [ "${#queue[@]}" -gt 0 ]; do
    current="${queue[0]}" queue=("${queue[@]:1}")
    while read -r next; do
        if [ -z "$next" ] || [ ! -f "$next" ] || [[ "$seen" == *" $next "* ]]; then continue; fi
        seen+="$next "
        queue+=("$next")
        echo
        echo "---- from ${next#"$ROOT"/} ----"
        header "$next"
    done < <(related "$current")
done
exit 0
