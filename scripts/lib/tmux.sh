# shellcheck shell=bash
# Shared logic of scripts/launch_<env>_grpo_tmux.sh: env servers (each in its own venv), the gateway and training,
# each in its own tmux window of one session, on a tmux server of its own (socket = session name, so the windows
# inherit this shell's environment: every setting of scripts/lib/common.sh reaches the training window).
#
#   bash scripts/launch_<env>_grpo_tmux.sh          start everything; training starts once every server is healthy
#   bash scripts/launch_<env>_grpo_tmux.sh stop     tear down: every process of every window, then the session
#   tmux -L <session> attach -t <session>           watch it
#
# Settings (defaults):
#   ENV_SERVER=<env>          built-in server module (env_gateway/servers/<ENV_SERVER>.py, run from .venvs/<ENV_SERVER>)
#   ENV_SERVER_URLS=          comma-separated URLs of servers started elsewhere (then none is started here; the
#                             only way for WebShop, WebArena, AppWorld, whose original servers need their own data)
#   ENV_REPLICAS=1  ENV_SERVER_PORT=<per env>  (replicas on consecutive ports; 0: each binds a free port and the
#                             launcher reads it from the server's window)   ENV_SERVER_ARGS=
#   ENV_HEALTH_PATH=/         health endpoint of an env server
#   GATEWAY_PORT=8800  GATEWAY_ARGS=           the gateway binds 127.0.0.1 (0: a free port, read from its window);
#                             COPE_GATEWAY_URL points training at it
#   TMUX_SESSION=cope-<env>   HEALTH_TIMEOUT=300 (seconds for all servers together)   STOP_TIMEOUT=20
#   LAUNCH_ONLY=1             bring up servers and gateway, stop before training (they keep running)
#   HOLD=1                    with LAUNCH_ONLY: stay in the foreground, tear down on SIGTERM/SIGINT (srun, sbatch)
#   DRY_RUN=1                 print each window's command and the training command; start nothing

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

tmux_cmd() {
    tmux -L "$TMUX_SESSION" "$@"
}

tmux_defaults() {
    : "${ENV_SERVER=$ENV_NAME}" "${ENV_SERVER_URLS:=}" "${ENV_REPLICAS:=1}" "${ENV_SERVER_ARGS:=}"
    : "${ENV_SERVER_PORT:=8100}" "${ENV_HEALTH_PATH:=/}" "${GATEWAY_PORT:=8800}" "${GATEWAY_ARGS:=}"
    : "${TMUX_SESSION:=cope-${ENV_NAME}}" "${HEALTH_TIMEOUT:=300}" "${STOP_TIMEOUT:=20}"
    COPE_GATEWAY_URL="http://127.0.0.1:${GATEWAY_PORT}"  # GATEWAY_PORT=0: set once the gateway has logged its port
    export COPE_GATEWAY_URL
    # per env server: its URL ("" until a port-0 server logs the port it bound) and its tmux window ("": started
    # elsewhere); SERVER_COMMANDS: the command of each window this launcher starts for a server
    SERVER_URLS=() SERVER_WINDOWS=() SERVER_COMMANDS=() SERVER_PYTHON=""
    local i
    if [ -n "$ENV_SERVER_URLS" ]; then
        IFS=, read -r -a SERVER_URLS <<<"$ENV_SERVER_URLS"
        for i in "${!SERVER_URLS[@]}"; do SERVER_WINDOWS+=(""); done
    elif [ -n "$ENV_SERVER" ]; then
        local python="$COPE_ROOT/.venvs/$ENV_SERVER/bin/python" port url
        SERVER_PYTHON="$python"
        for ((i = 0; i < ENV_REPLICAS; i++)); do
            port=$((ENV_SERVER_PORT == 0 ? 0 : ENV_SERVER_PORT + i)) url=""
            if [ "$port" != 0 ]; then url="http://127.0.0.1:$port"; fi
            SERVER_URLS+=("$url")
            SERVER_WINDOWS+=("$ENV_SERVER-$i")
            SERVER_COMMANDS+=("exec $(printf '%q' "$python") -m env_gateway.servers.$ENV_SERVER --host 127.0.0.1 --port $port $ENV_SERVER_ARGS")
        done
    else
        cope_die "$ENV_NAME has no built-in server: start its original server and set ENV_SERVER_URLS=http://HOST:PORT"
    fi
}

# The gateway's command, over SERVER_URLS (a URL not known yet is shown as what will fill it in).
tmux_gateway_command() {
    local urls=() i
    for i in "${!SERVER_URLS[@]}"; do
        urls+=("${SERVER_URLS[$i]:-http://127.0.0.1:<port ${SERVER_WINDOWS[$i]} logs>}")
    done
    echo "exec $(printf '%q' "$(cope_python)") -m env_gateway --host 127.0.0.1 --port $GATEWAY_PORT" \
        "--env $ENV_NAME=$(IFS=,; echo "${urls[*]}") $GATEWAY_ARGS"
}

# Every process of the session's windows, with all their descendants (pids, one per line).
tmux_session_pids() {
    local queue next pid
    queue="$(tmux_cmd list-panes -s -t "$TMUX_SESSION" -F '#{pane_pid}' 2>/dev/null)" || return 0
    while [ -n "$queue" ]; do
        next=""
        for pid in $queue; do
            echo "$pid"
            next+=" $(pgrep -P "$pid" | tr '\n' ' ')"
        done
        queue="$(echo "$next" | xargs)"
    done
}

tmux_running() {  # a zombie (exited, not yet reaped by tmux) counts as gone
    local state
    state="$(ps -o stat= -p "$1" 2>/dev/null)" && [[ "$state" != Z* ]]
}

tmux_teardown() {
    local pids pid deadline
    pids="$(tmux_session_pids | xargs)"
    if [ -n "$pids" ]; then
        # shellcheck disable=SC2086  # one pid per word
        kill -TERM $pids 2>/dev/null || true
        deadline=$((SECONDS + STOP_TIMEOUT))
        for pid in $pids; do
            while tmux_running "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
            if tmux_running "$pid"; then
                echo "teardown: pid $pid ignored SIGTERM for ${STOP_TIMEOUT}s; killing it" >&2
                kill -KILL "$pid" 2>/dev/null || true
            fi
        done
    fi
    local socket
    socket="$(tmux_cmd display-message -p '#{socket_path}' 2>/dev/null)" || true
    tmux_cmd kill-session -t "$TMUX_SESSION" 2>/dev/null || true  # the last session gone, the tmux server exits
    for _ in 1 2 3 4 5 6 7 8 9 10; do tmux_cmd ls >/dev/null 2>&1 || break; sleep 0.2; done
    if [ -n "$socket" ] && ! tmux_cmd ls >/dev/null 2>&1; then rm -f "$socket"; fi  # tmux leaves its socket file
    echo "teardown: session $TMUX_SESSION stopped${pids:+ (pids $pids)}"
}

tmux_window_dead() {
    [ "$(tmux_cmd display-message -p -t "$TMUX_SESSION:$1" '#{pane_dead}' 2>/dev/null)" = 1 ]
}

tmux_fail() {
    local window="$1" message="$2"
    echo "error: $message" >&2
    if [ -n "$window" ]; then
        echo "--- last lines of tmux window '$window' ---" >&2
        tmux_cmd capture-pane -p -J -t "$TMUX_SESSION:$window" -S -30 2>/dev/null | sed '/^$/d' | tail -n 20 >&2
    fi
    tmux_teardown >&2
    exit 1
}

# LOGGED_PORT := the port server $2 (started with --port 0) logged in tmux window $1 ("... listening on
# http://127.0.0.1:PORT"), waiting until HEALTH_DEADLINE; a server that died first, or never logs it, is named.
tmux_logged_port() {
    local window="$1" name="$2" line
    while true; do
        line="$(tmux_cmd capture-pane -p -J -t "$TMUX_SESSION:$window" -S - 2>/dev/null |
            grep -o -m 1 'listening on http://127\.0\.0\.1:[0-9]*')" || true
        if [ -n "$line" ]; then LOGGED_PORT="${line##*:}"; return; fi
        if tmux_window_dead "$window"; then
            tmux_fail "$window" "$name (window $window) exited before it logged the port it bound"
        fi
        if [ "$SECONDS" -ge "$HEALTH_DEADLINE" ]; then
            tmux_fail "$window" "$name (window $window) did not log the port it bound ('listening on ...') within ${HEALTH_TIMEOUT}s (HEALTH_TIMEOUT)"
        fi
        sleep 0.2
    done
}

# Waits until every server and then the gateway answer 200 on their health URL, until HEALTH_DEADLINE; the first
# that does not, or whose window died, is named.
tmux_wait_healthy() {
    local names=() urls=() windows=() i
    for i in "${!SERVER_URLS[@]}"; do
        names+=("$ENV_NAME server ${SERVER_URLS[$i]}") urls+=("${SERVER_URLS[$i]%/}$ENV_HEALTH_PATH")
        windows+=("${SERVER_WINDOWS[$i]}")
    done
    names+=(gateway) urls+=("$COPE_GATEWAY_URL/v1/health") windows+=(gateway)
    for i in "${!urls[@]}"; do
        until curl -fsS -m 2 -o /dev/null "${urls[$i]}" 2>/dev/null; do
            if [ -n "${windows[$i]}" ] && tmux_window_dead "${windows[$i]}"; then
                tmux_fail "${windows[$i]}" "${names[$i]} exited before it answered ${urls[$i]}"
            fi
            if [ "$SECONDS" -ge "$HEALTH_DEADLINE" ]; then
                tmux_fail "${windows[$i]}" "${names[$i]} never came up: ${urls[$i]} did not answer within ${HEALTH_TIMEOUT}s (HEALTH_TIMEOUT)"
            fi
            sleep 0.5
        done
        echo "healthy: ${names[$i]} (${urls[$i]})"
    done
    echo "all servers healthy"
}

# A window running $2, named $1; the first one creates the session.
tmux_window() {
    if tmux_cmd has-session -t "$TMUX_SESSION" 2>/dev/null; then
        tmux_cmd new-window -d -t "$TMUX_SESSION" -n "$1" "$2"
    else
        tmux_cmd new-session -d -s "$TMUX_SESSION" -n "$1" "$2"
        tmux_cmd set-option -t "$TMUX_SESSION" remain-on-exit on >/dev/null  # a crashed window keeps its last words
    fi
}

cope_tmux_main() {
    cope_load_secrets
    tmux_defaults
    cd "$COPE_ROOT" || exit 1
    if [ "${1:-}" = stop ]; then
        tmux_teardown
        return
    fi
    local i
    if cope_is_true "${DRY_RUN:-0}"; then
        for i in "${!SERVER_COMMANDS[@]}"; do echo "window ${SERVER_WINDOWS[$i]}: ${SERVER_COMMANDS[$i]}"; done
        echo "window gateway: $(tmux_gateway_command)"
        cope_is_true "${LAUNCH_ONLY:-0}" && return 0
        echo "window train: exec bash scripts/run_${ENV_NAME}_grpo_train.sh"
        bash "scripts/run_${ENV_NAME}_grpo_train.sh"
        return
    fi
    command -v tmux >/dev/null || cope_die "tmux is not installed (Debian: apt-get install tmux)"
    if ! cope_is_true "${LAUNCH_ONLY:-0}" && ! cope_is_true "${COPE_SKIP_PREFLIGHT:-0}"; then
        # the training run's preflight (all but the gateway, which starts below), before any server starts
        PREFLIGHT_ONLY=1 bash "scripts/run_${ENV_NAME}_grpo_train.sh" ||
            cope_die "the training run would fail (above); nothing was started (COPE_SKIP_PREFLIGHT=1 skips the checks)"
    fi
    if [ -n "$SERVER_PYTHON" ] && [ ! -x "$SERVER_PYTHON" ]; then
        local how="bash scripts/setup_env.sh $ENV_SERVER"
        if [ -f "env_gateway/servers/requirements/$ENV_SERVER.manual" ]; then
            how="the steps in env_gateway/servers/requirements/$ENV_SERVER.manual"
        fi
        cope_die "$SERVER_PYTHON not found: build the $ENV_SERVER server's venv first ($how)"
    fi
    if tmux_cmd has-session -t "$TMUX_SESSION" 2>/dev/null; then
        cope_die "tmux session $TMUX_SESSION is already running: stop it with \`bash $0 stop\` or set TMUX_SESSION"
    fi
    HEALTH_DEADLINE=$((SECONDS + HEALTH_TIMEOUT))
    if cope_is_true "${HOLD:-0}"; then trap 'tmux_teardown; exit 0' TERM INT; fi
    for i in "${!SERVER_COMMANDS[@]}"; do tmux_window "${SERVER_WINDOWS[$i]}" "${SERVER_COMMANDS[$i]}"; done
    for i in "${!SERVER_COMMANDS[@]}"; do
        if [ -z "${SERVER_URLS[$i]}" ]; then
            tmux_logged_port "${SERVER_WINDOWS[$i]}" "$ENV_NAME server"
            SERVER_URLS[i]="http://127.0.0.1:$LOGGED_PORT"
        fi
    done
    tmux_window gateway "$(tmux_gateway_command)"
    if [ "$GATEWAY_PORT" = 0 ]; then
        tmux_logged_port gateway gateway
        COPE_GATEWAY_URL="http://127.0.0.1:$LOGGED_PORT"
    fi
    tmux_wait_healthy
    if cope_is_true "${LAUNCH_ONLY:-0}"; then
        echo "LAUNCH_ONLY: servers and gateway are up at $COPE_GATEWAY_URL; stop with: bash $0 stop"
        if cope_is_true "${HOLD:-0}"; then
            while tmux_cmd has-session -t "$TMUX_SESSION" 2>/dev/null; do sleep 5 & wait $!; done
        fi
        return 0
    fi
    # the gateway's URL rides in the command: the tmux server's environment has the one set before it was known
    tmux_cmd new-window -d -t "$TMUX_SESSION" -n train \
        "COPE_GATEWAY_URL=$(printf '%q' "$COPE_GATEWAY_URL") exec bash scripts/run_${ENV_NAME}_grpo_train.sh"
    echo "training started in window 'train': tmux -L $TMUX_SESSION attach -t $TMUX_SESSION; stop with: bash $0 stop"
}
