// TraceML dashboard: polls /api/view every second and redraws; no reload, no CDN.
// The text (verdict, groups, tables) is drawn from the first view at once; Plotly is
// loaded after that first paint (its parse takes seconds on a busy machine) and the
// charts are drawn when it is there.
"use strict";
(function () {
  const REFRESH_MS = 1000;
  const ANSWER_WITHIN_MS = 10000;
  const extraRanks = new Set();
  let lastView = null;
  let failures = 0;
  let goneSince = null;
  const PLOT_CONFIG = { displayModeBar: false, responsive: true };
  const $ = (id) => document.getElementById(id);

  function text(id, value) { $(id).textContent = value == null ? "" : String(value); }
  function fmt(x, digits) {
    if (x == null || Number.isNaN(x)) return "n/a";
    return Number(x).toFixed(digits == null ? 2 : digits);
  }
  function bytes(n) {
    if (n == null) return "n/a";
    let v = Number(n);
    for (const unit of ["B", "KiB", "MiB", "GiB", "TiB"]) {
      if (v < 1024 || unit === "TiB") return unit === "B" ? `${v.toFixed(0)} B` : `${v.toFixed(1)} ${unit}`;
      v /= 1024;
    }
    return `${n} B`;
  }
  // Plotly reads a trace's name as markup (<b>, <br>, <span style>, &amp; ...): a user's
  // string (a phase name) goes in with its markup characters as entities, so it is
  // shown as written.
  function plain(value) {
    return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }
  function pct(x) { return x == null ? "n/a" : `${Number(x).toFixed(0)}%`; }
  function el(tag, cls, content) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (content != null) e.textContent = String(content);
    return e;
  }
  function table(headers, rows, rowClass) {
    const t = el("table");
    const head = el("tr");
    headers.forEach((h) => head.appendChild(el("th", null, h)));
    const thead = el("thead"); thead.appendChild(head); t.appendChild(thead);
    const body = el("tbody");
    rows.forEach((cells, i) => {
      const tr = el("tr", rowClass ? rowClass(i) : null);
      cells.forEach((c) => tr.appendChild(el("td", null, c)));
      body.appendChild(tr);
    });
    t.appendChild(body);
    return t;
  }
  function replace(id, node) { const box = $(id); box.replaceChildren(node); }

  function layout(extra) {
    return Object.assign({
      margin: { l: 56, r: 12, t: 8, b: 40 }, showlegend: true,
      legend: { orientation: "h", y: -0.2 }, hovermode: "x unified",
      paper_bgcolor: "#fff", plot_bgcolor: "#fff",
      xaxis: { gridcolor: "#eee" }, yaxis: { gridcolor: "#eee", rangemode: "tozero" },
    }, extra || {});
  }

  function charts() { return typeof window.Plotly !== "undefined"; }
  let plotlyAsked = false;
  function loadPlotly() {
    if (plotlyAsked) return;
    plotlyAsked = true;
    const script = document.createElement("script");
    script.src = "/static/plotly.min.js";
    script.onload = () => {
      if (lastView) drawCharts(lastView);
      // When the charts were first drawn (ms since navigation started), for the bench.
      requestAnimationFrame(() => setTimeout(() => {
        window.tracemlChartsMs = performance.now();
        document.documentElement.dataset.charts = "1";
      }, 0));
    };
    document.body.appendChild(script);
  }

  // One box per grouping (node, stage, data-parallel group), kept from view to view so
  // that its chart is updated in place, not made again each second.
  function drawGroups(view) {
    const groups = view.groups || [];
    $("groups-box").hidden = !groups.length;
    const holder = $("groups");
    const wanted = new Set(groups.map((g) => `group-${g.by}`));
    [...holder.children].forEach((child) => { if (!wanted.has(child.id)) child.remove(); });
    groups.forEach((g) => {
      let box = $(`group-${g.by}`);
      if (!box) {
        box = el("div", "group");
        box.id = `group-${g.by}`;
        box.appendChild(el("h3"));
        const chart = el("div", "chart group-chart");
        chart.id = `chart-group-${g.by}`;
        box.appendChild(chart);
        box.appendChild(el("div", "group-table"));
        holder.appendChild(box);
      }
      const title = box.querySelector("h3");
      title.replaceChildren(document.createTextNode(`By ${g.word} `),
        el("span", "muted", `(${g.count.toLocaleString()} ${g.word}s${g.rows_note ? `; ${g.rows_note}` : ""})`));
      box.querySelector(".group-chart").hidden = !g.chart;
      const t = table([g.word, "ranks", "p50 ms", "p90 ms", "max ms", "slowest rank", "named ranks"],
        g.rows.map((r) => [r.group, r.ranks, fmt(r.p50_ms), fmt(r.p90_ms), fmt(r.max_ms), r.slowest_rank,
          r.named_count ? `${r.named.join(", ")}${r.named_count > r.named.length ? ` (+${r.named_count - r.named.length})` : ""}` : ""]),
        (i) => (g.rows[i].named_count ? "straggler" : null));
      t.dataset.by = g.by;
      box.querySelector(".group-table").replaceChildren(t);
    });
  }

  function drawGroupCharts(view) {
    for (const g of view.groups || []) {
      if (!g.chart || !$(`chart-group-${g.by}`)) continue; // more groups than the chart draws
      const c = g.chart;
      Plotly.react(`chart-group-${g.by}`, [
        { x: c.group, y: c.p50_ms, mode: "lines", name: "p50 of its ranks", line: { color: "#1d232b", width: 1.5 } },
        { x: c.group, y: c.p90_ms, mode: "lines", name: "p90", line: { color: "#667085", width: 1 } },
        { x: c.group, y: c.max_ms, mode: "markers", name: "max (its slowest rank)", marker: { color: "#c4320a", size: 4 } },
      ], layout({ xaxis: { title: { text: g.word }, gridcolor: "#eee" }, yaxis: { title: { text: "ms" }, gridcolor: "#eee", rangemode: "tozero" } }), PLOT_CONFIG);
    }
  }

  function drawCharts(view) {
    if (!charts()) return;
    drawSteps(view); drawPhases(view); drawThroughput(view); drawGroupCharts(view);
  }

  function drawSteps(view) {
    const s = view.step_time;
    const x = s.steps;
    const traces = [];
    if (s.band) {
      traces.push({ x, y: s.p10, mode: "lines", line: { width: 0 }, name: "p10", showlegend: false, hoverinfo: "skip" });
      traces.push({ x, y: s.p90, mode: "lines", line: { width: 0 }, fill: "tonexty", fillcolor: "rgba(120,130,150,0.25)", name: "p10–p90 of ranks" });
      traces.push({ x, y: s.median, mode: "lines", line: { color: "#1d232b", width: 2 }, name: "median of ranks" });
    }
    for (const line of s.lines) {
      traces.push({
        x, y: line.values, mode: "lines", name: `rank ${line.rank}${line.straggler ? " (straggler)" : ""}`,
        line: { width: line.straggler ? 3 : 1.5, dash: line.on_demand ? "dot" : "solid" },
      });
    }
    const caption = s.bin > 1 ? `(ms; each point the mean of ${s.bin} steps)` : "(ms)";
    text("step-caption", `${caption} · ${s.band ? "median and spread of all ranks, the slowest drawn alone" : "every rank"}`);
    Plotly.react("chart-steps", traces, layout({ xaxis: { title: { text: "step" }, gridcolor: "#eee" }, yaxis: { title: { text: "ms" }, gridcolor: "#eee", rangemode: "tozero" } }), PLOT_CONFIG);
  }

  function drawPhases(view) {
    const p = view.phases;
    const x = p.ranks.map((r) => `rank ${r}`);
    const traces = p.names.map((name) => ({
      type: "bar", name: plain(name), x, y: p.mean_ms[name], marker: { color: p.colours[name] },
    }));
    Plotly.react("chart-phases", traces, layout({ barmode: "stack", hovermode: "closest", yaxis: { title: { text: "ms" }, gridcolor: "#eee" } }), PLOT_CONFIG);
  }

  function drawThroughput(view) {
    const t = view.throughput;
    text("throughput-caption", t.job_steps_per_s == null ? "" : `(job: ${fmt(t.job_steps_per_s)} steps/s, the slowest rank's rate)`);
    Plotly.react("chart-throughput", [{ x: t.steps, y: t.steps_per_s, mode: "lines", name: "steps/s (median over ranks)", line: { color: "#027a48" } }],
      layout({ xaxis: { title: { text: "step" }, gridcolor: "#eee" }, yaxis: { title: { text: "steps/s" }, gridcolor: "#eee", rangemode: "tozero" } }), PLOT_CONFIG);
  }

  function drawRanks(view) {
    const body = document.querySelector("#ranks-table tbody");
    const rows = view.ranks.map((r) => {
      const tr = el("tr", r.straggler ? "straggler" : null);
      tr.dataset.rank = r.rank;
      const phase = r.largest_phase ? `${(r.largest_phase_share * 100).toFixed(0)}% ${r.largest_phase}` : "";
      [`${r.rank}${r.straggler ? " *" : ""}`, r.node == null ? "" : r.node, r.steps, fmt(r.p50_ms), fmt(r.p90_ms), fmt(r.p99_ms), fmt(r.max_ms), fmt(r.steps_per_s), phase]
        .forEach((c) => tr.appendChild(el("td", null, c)));
      return tr;
    });
    body.replaceChildren(...rows);
    text("ranks-caption", [view.window, view.ranks_shown_note].filter(Boolean).join(" · "));
  }

  function drawSpread(view) {
    const rows = (view.spread || []).map((r) => {
      const tr = el("tr");
      [r.figure, fmt(r.min), fmt(r.p50), fmt(r.p90), fmt(r.max)].forEach((c) => tr.appendChild(el("td", null, c)));
      return tr;
    });
    document.querySelector("#spread-table tbody").replaceChildren(...rows);
    const stages = view.stages || [];
    $("stages-box").hidden = !stages.length;
    const stageRows = stages.map((s) => {
      const tr = el("tr", s.slow ? "straggler" : null);
      [`${s.stage}${s.slow ? " (slow)" : ""}`, s.ranks, fmt(s.p50_ms), fmt(s.own_work_ms)].forEach((c) => tr.appendChild(el("td", null, c)));
      return tr;
    });
    document.querySelector("#stages-table tbody").replaceChildren(...stageRows);
  }

  function drawMemory(view) {
    text("memory-caption", view.memory_basis ? `(${view.memory_basis})` : "");
    if (view.memory == null) { replace("memory", el("p", "muted", "not available (step_memory not exported)")); return; }
    if (!view.memory.length) { replace("memory", el("p", "muted", "no figures yet")); return; }
    replace("memory", table(["rank", "device", "peak allocated", "peak reserved"],
      view.memory.map((m) => [m.rank, m.device, bytes(m.peak_allocated_bytes), bytes(m.peak_reserved_bytes)])));
  }

  function drawProcess(view) {
    text("process-caption", view.process_basis ? `(${view.process_basis})` : "");
    if (view.process == null) { replace("process", el("p", "muted", "not available (process not exported)")); return; }
    if (!view.process.length) { replace("process", el("p", "muted", "no sample yet")); return; }
    replace("process", table(["rank", "CPU", "RSS", "GPU memory used", "GPU memory reserved"],
      view.process.map((p) => [p.rank, pct(p.cpu_percent), bytes(p.ram_used_bytes), bytes(p.gpu_memory_used_bytes), bytes(p.gpu_memory_reserved_bytes)])));
  }

  function drawSystem(view) {
    text("system-caption", [view.system_basis ? `(${view.system_basis})` : "", view.system_note || ""].filter(Boolean).join(" · "));
    const spread = view.system_spread || [];
    const bytesRow = (r) => r.figure.includes("bytes");
    replace("system-spread", spread.length
      ? table(["across nodes", "min", "p50", "p90", "max"], spread.map((r) => [r.figure,
        ...[r.min, r.p50, r.p90, r.max].map((v) => (bytesRow(r) ? bytes(v) : fmt(v, 1)))]))
      : el("span"));
    if (view.system == null) { replace("system", el("p", "muted", "not available (system not exported)")); return; }
    if (!view.system.length) { replace("system", el("p", "muted", "no sample yet")); return; }
    const box = el("div");
    box.appendChild(table(["node", "CPU", "RAM used", "RAM total", "GPUs"],
      view.system.map((n) => [n.node, pct(n.cpu_percent), bytes(n.ram_used_bytes), bytes(n.ram_total_bytes), n.gpus.length])));
    const gpus = [];
    view.system.forEach((n) => n.gpus.forEach((g) => gpus.push([n.node, g.index, pct(g.utilization_percent), bytes(g.memory_used_bytes), bytes(g.memory_total_bytes), g.temperature_c == null ? "n/a" : `${fmt(g.temperature_c, 0)} °C`, g.power_usage_w == null ? "n/a" : `${fmt(g.power_usage_w, 0)} W`])));
    if (gpus.length) box.appendChild(table(["node", "GPU", "utilization", "memory used", "memory total", "temperature", "power"], gpus));
    else box.appendChild(el("p", "muted", "no GPU on the host(s)"));
    replace("system", box);
  }

  function drawLoss(view) {
    const loss = view.loss || {};
    const status = $("loss-status");
    status.textContent = loss.status || "";
    status.className = `badge ${loss.status || ""}`;
    const items = [...(loss.lines || []), ...view.problems.map((p) => `problem: ${p}`)];
    $("loss").replaceChildren(...items.map((l) => el("li", null, l)));
    const warning = $("warning");
    if (loss.warning) {
      warning.hidden = false;
      warning.textContent = `${loss.warning_file || "finalization_warning.json"}:\n${JSON.stringify(loss.warning, null, 2)}`;
    } else {
      warning.hidden = true;
    }
  }

  function render(view) {
    const id = view.identity;
    text("run-name", id.run_name || id.run_folder || "");
    const status = $("status");
    status.textContent = `${view.source === "live" ? "live" : "from files"}: ${view.status}`;
    status.className = `badge ${view.finished ? "finished" : ""}`;
    status.dataset.finished = String(view.finished);
    const parts = [];
    if (id.world_size != null) parts.push(`world size ${id.world_size}`);
    parts.push(`${id.ranks_reporting} rank(s) with steps`);
    if (id.node_count) parts.push(`${id.node_count.toLocaleString()} node(s)`);
    if (id.strategy) parts.push(`strategy ${id.strategy}`);
    if (id.host) parts.push(`aggregator on ${id.host}`);
    if (id.run_folder) parts.push(id.run_folder);
    text("identity", parts.join(" · "));
    text("updated", `updated ${new Date(view.generated_unix_s * 1000).toLocaleTimeString()}`);
    const verdict = $("verdict");
    verdict.textContent = view.straggler.line;
    verdict.className = view.straggler.verdict || "";
    verdict.title = view.straggler.definition || "";
    text("cost", view.straggler.cost || "");
    text("window", view.waiting ? `waiting: ${view.waiting}` : view.window);
    const notes = view.notes || [];
    $("notes-box").hidden = !notes.length;
    $("notes").replaceChildren(...notes.map((n) => el("li", null, n)));
    drawGroups(view); drawCharts(view);
    drawSpread(view); drawRanks(view); drawMemory(view); drawProcess(view); drawSystem(view); drawLoss(view);
    text("rank-picked", extraRanks.size ? `also shown: ${[...extraRanks].sort((a, b) => a - b).join(", ")}` : "");
  }

  function showError(message) {
    const box = $("error");
    box.hidden = !message;
    box.textContent = message || "";
  }

  // The live page is served by the aggregator itself: no answer at all (not an HTTP
  // error) means it has stopped (killed, crashed) or cannot be reached any more.
  function showGone(view, why) {
    if (goneSince == null) goneSince = new Date();
    const status = $("status");
    status.textContent = "live: aggregator gone";
    status.className = "badge lost";
    status.dataset.gone = "true";
    const loss = $("loss-status");
    loss.textContent = "aggregator gone";
    loss.className = "badge lost";
    const files = view.identity.export_folder
      ? "the export files keep what it had written, without closing lines (traceml run writes " +
        "finalization_warning.json when training ends)"
      : "export was off, so no file holds the run";
    const command = view.identity.files_command;
    showError(
      `The aggregator does not answer (since ${goneSince.toLocaleTimeString()}: ${why}). ` +
      "It serves this page, so it has stopped (killed or crashed) or this browser can no " +
      "longer reach it. If it has stopped, training goes on without it and nothing more " +
      `is recorded: ${files}.` +
      (command && view.identity.export_folder ? ` ${command} shows what they hold.` : "")
    );
  }

  // The page's first meaningful paint: the first view rendered and then painted (the
  // frame after it). <html data-ready="1"> then, and performance.now() at that moment
  // (ms since navigation started) in window.tracemlFirstPaintMs, which the tests and
  // bench.dashboard --paint read.
  function markReady() {
    if (document.documentElement.dataset.ready) return;
    requestAnimationFrame(() => setTimeout(() => {
      if (document.documentElement.dataset.ready) return;
      window.tracemlFirstPaintMs = performance.now();
      document.documentElement.dataset.ready = "1";
      loadPlotly();
    }, 0));
  }

  // The first view leaves the lines over steps out (?charts=0): the charts wait for
  // Plotly anyway, and those lines are most of a large run's view to make.
  let firstShown = false;
  async function poll() {
    const params = [];
    if (extraRanks.size) params.push(`ranks=${[...extraRanks].join(",")}`);
    if (!firstShown) params.push("charts=0");
    const query = params.length ? `?${params.join("&")}` : "";
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), ANSWER_WITHIN_MS);
    try {
      let response;
      try {
        response = await fetch(`/api/view${query}`, { cache: "no-store", signal: abort.signal });
      } catch (err) {
        err.noAnswer = true; // refused, reset or timed out: nothing answered
        throw err;
      }
      const body = await response.json();
      if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
      lastView = body;
      failures = 0;
      goneSince = null;
      delete $("status").dataset.gone;
      showError(null);
      render(body);
      markReady();
      firstShown = true;
    } catch (err) {
      failures += 1;
      if (lastView && lastView.source === "live" && lastView.finished) {
        const command = lastView.identity.files_command;
        showError(`The run has finalized and its live page has stopped. ${command ? `${command} shows it from its files.` : ""}`);
        return; // the aggregator is gone: nothing more to fetch
      }
      const why = err.name === "AbortError" ? `no answer within ${ANSWER_WITHIN_MS / 1000} s` : (err.message || String(err));
      if (err.noAnswer && lastView && lastView.source === "live") showGone(lastView, why);
      else showError(`cannot refresh (${why}); retrying`);
    } finally {
      clearTimeout(timer);
    }
    setTimeout(poll, failures > 5 ? 5 * REFRESH_MS : REFRESH_MS);
  }

  function rangesText(ranges) {
    return ranges.map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(", ");
  }

  // Only ranks the run has: one the page cannot draw is refused, with the reason.
  $("rank-add").addEventListener("click", () => {
    const refused = [];
    const ranges = lastView ? lastView.rank_ranges : [];
    const limit = lastView ? lastView.max_extra_ranks : 0;
    for (const part of $("rank-input").value.split(/[ ,]+/)) {
      if (!part) continue;
      if (!/^\d+$/.test(part)) { refused.push(`${part} (not a rank number)`); continue; }
      const rank = Number(part);
      if (!ranges.some(([a, b]) => a <= rank && rank <= b)) { refused.push(`${rank} (no such rank)`); continue; }
      if (!extraRanks.has(rank) && extraRanks.size >= limit) { refused.push(`${rank} (at most ${limit} ranks at once)`); continue; }
      extraRanks.add(rank);
    }
    const box = $("rank-refused");
    box.hidden = !refused.length;
    box.textContent = refused.length
      ? `not shown: ${refused.join(", ")}; ranks with steps: ${ranges.length ? rangesText(ranges) : "none yet"}`
      : "";
    $("rank-input").value = "";
    if (lastView) render(lastView);
  });
  $("rank-clear").addEventListener("click", () => {
    extraRanks.clear();
    $("rank-refused").hidden = true;
    if (lastView) render(lastView);
  });
  poll();
})();
