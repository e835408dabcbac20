# Checks the suite scripts share (sourced): one line on stderr and exit 1 (2: a wrong argument) before any work.
whole_numbers() {  # VAR...: each a whole number > 0 (SEED: >= 0); an empty or unset one is skipped
  local var value
  for var in "$@"; do
    value=${!var:-}
    [ -n "$value" ] || continue
    [[ $value =~ ^(0|[1-9][0-9]{0,17})$ ]] && { [ "$var" = SEED ] || [ "$value" -gt 0 ]; } ||  # (08: bash's octal;
      { echo "error: $var=$value: want a whole number$([ "$var" = SEED ] || echo ' > 0')$([[ $value =~ ^0[0-9] ]] &&
          echo ' (no leading 0)')$([[ $value =~ ^[0-9]{19,}$ ]] && echo ' of at most 18 digits')" >&2; exit 1; }  # 2^63)
  done
}
at_most() {  # POWER VAR...: each at most 2^POWER, train.py's and eval.py's own limit (steps 2^40, examples and
  # batches 2^20), checked before the first run rather than by each run in turn
  local power=$1 var; shift
  for var in "$@"; do
    [ -z "${!var:-}" ] || [ "${!var}" -le $(( 1 << power )) ] ||
      { echo "error: $var=${!var}: want at most 2^$power (train.py's and eval.py's limit)" >&2; exit 1; }
  done
}
arguments() {  # WORD "$@": -h / --help prints the script's header and settings, and exits 0; an argument other
  # than WORD (one optional word, such as --smoke; "": none) is a one-line error, before any work
  local word=$1 script=scripts/$(basename "$0"); shift
  case "${1:-}" in -h|--help)
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$script"
    echo "settings (NAME=value bash $script), their defaults:"
    grep -E '^[A-Z_]+=\$\{[A-Z_]+:?-' "$script" | sed 's/^/  /'
    exit 0 ;;
  esac
  [ $# -eq 0 ] || { [ $# -eq 1 ] && [ -n "$word" ] && [ "$1" = "$word" ]; } ||
    { echo "error: unknown argument(s) $*; usage: bash $script${word:+ [$word]} (settings are variables: --help)" >&2; exit 2; }
}
same_code() {  # OUT: its runs were trained by this code (OUT/code.txt: the commit and a hash of the edits since), so
  # that the same command again resumes them; runs of other code would be resumed as they are: one line
  local now
  now="$(git rev-parse --short HEAD 2> /dev/null || echo none) $(git diff HEAD 2> /dev/null | sha1sum | cut -c1-12)"
  if [ -f "$1/code.txt" ] && [ "$(cat "$1/code.txt")" != "$now" ]; then
    echo "error: OUT=$1 holds runs of other code ($(cat "$1/code.txt"); now $now), which the suite would resume:" \
      "name another OUT, or delete it" >&2; exit 1
  fi
  mkdir -p "$1" 2> /dev/null && echo "$now" > "$1/code.txt" ||
    { echo "error: OUT=$1: cannot make this folder (a file is in its way?)" >&2; exit 1; }
}
stop_runs() {  # trap stop_runs EXIT: on exit (a run failed, Ctrl-C) the runs still going save their step and stop
  # (SIGTERM, as train.py's Ctrl-C; a job may be a subshell running one); the same command again resumes them
  for p in $(jobs -p); do pkill -TERM -P "$p" 2> /dev/null || true; kill "$p" 2> /dev/null || true; done  # (set -e)
}
[ -z "${OUT:-}" ] || [ -n "${OUT// }" ] ||  # (OUT=" " made a folder " -smoke" in the repo)
  { echo "error: OUT='$OUT': a blank name; name a folder" >&2; exit 1; }
