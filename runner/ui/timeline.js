// One turn of a chat's timeline, and one turn's diagnosis: pure functions of the JSON the
// daemon returns (a turn with its receipt; a Diagnosis), so they can be rendered alone.

import { NOT_AVAILABLE, code, el, facts, ms, when } from "./dom.js";

const STATUSES = ["NEW", "LIVE", "RESTORED", "LOST"];

export function badge(status) {
  const known = STATUSES.includes(status);
  const label = status || "NO STATUS";
  return el("span", { class: `badge badge-${known ? status.toLowerCase() : "none"}` }, label);
}

export function timingBar(t) {
  t = t || {};
  const parts = [["sandbox", t.sandbox || 0], ["process", t.process || 0], ["turn", t.turn || 0]];
  const other = Math.max(0, (t.total || 0) - parts.reduce((a, [, v]) => a + v, 0));
  parts.push(["other", other]);
  const total = Math.max(1, t.total || parts.reduce((a, [, v]) => a + v, 0));
  const words = parts.filter(([, v]) => v > 0).map(([k, v]) => `${k} ${ms(v)}`).join(", ");
  const bar = el("div", { class: "timing-bar", role: "img",
                          "aria-label": `timings: ${words || "none"}; total ${ms(t.total)}` });
  for (const [name, value] of parts) {
    if (value <= 0) continue;
    const seg = el("span", { class: `seg seg-${name}`, title: `${name} ${ms(value)}` });
    seg.style.flexGrow = String(value / total);  // CSSOM, not a style attribute (CSP)
    bar.append(seg);
  }
  const legend = el("p", { class: "timing-legend" },
    parts.map(([name, value]) => el("span", { class: "legend-item" },
      el("span", { class: `swatch seg-${name}`, "aria-hidden": "true" }), `${name} ${ms(value)}`)),
    el("span", { class: "legend-item legend-total" }, `total ${ms(t.total)}`));
  return el("div", { class: "timing" }, bar, legend);
}

export function wireFacts(wire) {
  if (!wire) return [["Wire", el("span", { class: "na" }, NOT_AVAILABLE)]];
  const counts = `${wire.requests ?? "?"} request(s), ${wire.side_requests ?? 0} side`;
  const rows = [["Wire", el("span", {}, el("span", { class: `wire wire-${wire.history}` }, wire.history), ` · ${counts}`)]];
  const d = wire.first_difference;
  if (d) {
    const parts = [
      el("span", { class: "diff-where" }, `message ${d.index} (${d.role})`),
      el("span", { class: "diff-digest" }, "expected ", code(d.expected_digest, 16)),
      el("span", { class: "diff-digest" }, "observed ", code(d.observed_digest, 16)),
    ];
    if (d.expected_text != null) parts.push(el("span", { class: "diff-text" }, "expected text: ", el("q", {}, d.expected_text)));
    if (d.observed_text != null) parts.push(el("span", { class: "diff-text" }, "observed text: ", el("q", {}, d.observed_text)));
    rows.push(["First difference", el("span", { class: "diff" }, parts)]);
  }
  return rows;
}

export function renderTurn(turn, { onDiagnose } = {}) {
  const r = turn.receipt;
  const status = r ? r.context_status : null;
  const id = `turn-${turn.index}`;
  const row = el("li", { class: "turn", id, tabindex: "0", "aria-labelledby": `${id}-title`,
                         "data-index": turn.index, "data-job": turn.job_id, "data-status": status || "" });
  const head = el("div", { class: "turn-head" },
    el("h4", { class: "turn-title", id: `${id}-title` }, `Turn ${turn.index}`),
    r ? badge(status) : el("span", { class: "badge badge-running" }, "RUNNING"),
    r ? el("span", { class: `outcome outcome-${r.outcome}` }, r.outcome) : null,
    r && r.reason ? el("span", { class: "reason" }, "reason ", el("strong", {}, r.reason)) : null,
    el("span", { class: "who" }, `${turn.member_id}${r ? " · " + r.runtime : ""}`),
    el("span", { class: "started" }, when(turn.started_at)));
  row.append(head);
  if (!r) {
    row.append(facts([["Job", code(turn.job_id)], ["State", "running: no receipt yet"]]));
    return row;
  }
  const s = r.settlement || {};
  const settlement = s.evidence
    ? [s.evidence, s.is_error ? " (is_error)" : "", s.detail ? ` — ${s.detail}` : ""].join("")
    : (s.detail ? `none — ${s.detail}` : "none");
  const sb = r.sandbox || {};
  row.append(facts([
    ["Job", code(turn.job_id)],
    ["Locator", el("span", { class: "locator" }, code(r.locator_before), " → ", code(r.locator_after))],
    ["Settlement", settlement],
    ...wireFacts(r.wire),
    ["Sandbox", el("span", {}, "container ", code(sb.container_id, 12), " · image ", code(sb.image_id, 19))],
    ["Versions", `CLI ${r.cli_version || NOT_AVAILABLE} · helper ${sb.helper_version || NOT_AVAILABLE}`],
    ["Reply", `${(r.assistant_text || "").length} characters`],
  ]));
  row.append(timingBar(r.timings_ms));
  if (onDiagnose) {
    const out = el("div", { class: "diagnosis", hidden: true });
    const button = el("button", { type: "button", class: "diagnose", "aria-expanded": "false",
                                  "aria-controls": `${id}-diagnosis` }, `Diagnose turn ${turn.index}`);
    out.id = `${id}-diagnosis`;
    button.addEventListener("click", () => onDiagnose(turn, button, out));
    row.append(button, out);
  }
  return row;
}

export function renderDiagnosis(d) {
  const steps = el("ol", { class: "steps" }, d.steps.map((step) => el("li", { class: `step step-${step.verdict}` },
    el("p", { class: "step-head" }, el("strong", {}, step.title), " ",
       el("span", { class: `verdict verdict-${step.verdict}` }, step.verdict), " ", step.summary),
    facts(step.facts.map((f) => [f.label, f.value]), "facts small"))));
  return el("div", { class: "diagnosis-body" }, steps,
    el("p", { class: `conclusion kind-${d.kind}` }, el("strong", {}, "Conclusion: "), d.conclusion));
}

