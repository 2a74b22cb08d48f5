# The steps of scripts/test.sh (sourced): step runs one, keeps its pass count and
# time for the summary and ends whatever it left running; stopped (the INT/TERM
# trap) ends every process the command started and sums up what ran.
# Sourced by scripts/test.sh, and by tests/test_test_steps.py to check that.
SUMMARY=()
FAILURES=()     # a failed step's failing tests (pytest's FAILED and ERROR lines), else its last lines
FAILED=0        # the first failed step's exit status: every later step still runs
BEGAN=$SECONDS
# stopped part way (Ctrl-C, a CI limit, a kill): every process the command started is
# ended (a step runs in the background, so the signal is handled at once), and what
# ran is still summed up
descendants() {   # every process below this shell, listed before any is signalled
    local all queue=($$) found=() p child
    all=$(ps -eo pid=,ppid=)
    while [ ${#queue[@]} -gt 0 ]; do
        p=${queue[0]}
        queue=("${queue[@]:1}")
        for child in $(awk -v p="$p" '$2 == p { print $1 }' <<< "$all"); do
            found+=("$child")
            queue+=("$child")
        done
    done
    echo "${found[@]}"
}
# every process a step starts carries MPIGRAD_TEST_STEP=<this shell's pid>-<step> in its
# environment, inherited by its children whoever their parent becomes (a process whose
# parent is killed goes to init, out of the tree above)
marked() {   # the processes whose environment has the mark given (a prefix of one)
    grep -lsz "^MPIGRAD_TEST_STEP=$1" /proc/[0-9]*/environ 2>/dev/null \
        | awk -F/ -v self=$$ '$3 != self { print $3 }' || true
}
end_marked() {   # TERM what marked $1 lists, KILL what of it is left after 3 s, and scan
    # again until three scans 0.1 s apart find none: a process in the middle of an exec
    # shows no environment for a moment, and a scan then misses it (ten rounds at most: a
    # process the kernel holds is not waited for forever); how many were ended
    local ended=() now empty=0 rounds=0 waited
    while [ $empty -lt 3 ] && [ $rounds -lt 10 ]; do
        now=$(marked "$1")
        if [ -z "$now" ]; then
            empty=$((empty + 1))
            sleep 0.1
            continue
        fi
        empty=0
        rounds=$((rounds + 1))
        ended+=($now)
        kill -TERM $now 2>/dev/null
        for waited in {1..30}; do      # (a zombie has no environment: ended, unlisted)
            [ -n "$(marked "$1")" ] || break
            sleep 0.1
        done
        now=$(marked "$1")
        ended+=($now)
        [ -z "$now" ] || kill -KILL $now 2>/dev/null
    done
    [ ${#ended[@]} = 0 ] && echo 0 || printf '%s\n' "${ended[@]}" | sort -u | wc -l
}
stopped() {   # (in a step: its log and count files are its locals, removed here)
    trap - INT TERM
    set +e        # a kill of a process already gone must not end the stop before its summary
    local left
    left=$(descendants)
    [ -z "$left" ] || kill -TERM $left 2>/dev/null
    end_marked "$$-" > /dev/null
    left=$(descendants)
    [ -z "$left" ] || kill -KILL $left 2>/dev/null
    # last: a step's subshell, ended by the TERM above, still writes its count file
    rm -f "${log:-}" "${ended:-}"
    echo "== stopped"
    summary
    exit 130
}
summary() {   # the failed steps' own lines first: a CI log is often read from its end
    local line
    if [ ${#FAILURES[@]} -gt 0 ]; then
        echo "== what the failed steps said last"
        for line in "${FAILURES[@]}"; do
            echo "$line"
        done
    fi
    local IFS=";"
    echo "== summary ($((SECONDS - BEGAN)) s):${SUMMARY[*]}"
}

quiet() {   # the output of a step less pytest-mpi's "MPI Information" block, which
    # every rank of every MPI step prints (the library's version: the header says it)
    awk '/^=+ MPI Information =+$/ { skip = 1; next }
         skip && /^mpi4py config:/ { skip = 2; next }
         skip == 1 || (skip == 2 && /^ /) { next }
         { skip = 0; print; fflush() }'
}

STEPS=0
step() {   # a label, then a command: run it, keep its pass count and time; what it left
    # running is ended and counted
    local label=$1 began=$SECONDS log ended rc counts mark left
    shift
    echo "== $label"
    log=$(mktemp)
    ended=$(mktemp)
    mark="$$-$((STEPS += 1))-"
    set +e
    # what the command leaves running is ended as it exits (it may hold the pipe open)
    ( ( MPIGRAD_TEST_STEP=$mark "$@" 2>&1; rc=$?; end_marked "$mark" > "$ended"; exit $rc ) \
        | quiet | tee "$log"; exit "${PIPESTATUS[0]}" ) &
    wait $!
    rc=$?
    set -e
    left=$(cat "$ended")
    rm -f "$ended"
    # pytest's count line, mypy's, import-linter's, Slurm's: each rank prints pytest's,
    # and ranks can differ (a rank alone in a split skips what needs two): each
    # different line once, in order, joined by " / "
    counts=$(grep -aoE "^([0-9]+ (passed|failed|skipped|deselected|error)(, )?)+|^Success: no issues|^Contracts: [0-9]+ kept, [0-9]+ broken|^[0-9]+ passed, [0-9]+ failed" \
             "$log" | sed -E 's/, $//' | awk '!seen[$0]++' | paste -sd '\t' \
             | sed 's|\t| / |g' || true)   # none: a step that ended early
    if [ "$rc" != 0 ]; then
        local said line
        said=$(grep -aE "^(FAILED|ERROR) " "$log" | awk '!seen[$0]++' | head -20 || true)
        [ -n "$said" ] || said=$(tail -5 "$log")
        while IFS= read -r line; do
            FAILURES+=("$label: $line")
        done <<< "${said:-(it printed nothing)}"
    fi
    rm -f "$log"
    SUMMARY+=(" $label: ${counts:-done}$([ "$rc" = 0 ] || echo ", FAILED (exit $rc)")$(
        [ "${left:-0}" = 0 ] || echo ", $left processes left running (ended)") ($((SECONDS - began)) s)")
    echo "== result:${SUMMARY[-1]}"       # as the step ends: a partial run still shows it
    if [ "$rc" != 0 ] && [ "$FAILED" = 0 ]; then
        FAILED=$rc
    fi
}

