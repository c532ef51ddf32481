// The host page: attestation summary, residents against the memory budget, the queue and
// the retained sandboxes.

import { getJSON } from "./api.js";
import { NOT_AVAILABLE, clear, code, el, facts, na, when } from "./dom.js";

const MB = 1024 * 1024;

function table(caption, columns, rows, id) {
  return el("div", { class: "table-wrap" },
    el("table", { class: "grid", id },
      el("caption", {}, caption),
      el("thead", {}, el("tr", {}, columns.map((c) => el("th", { scope: "col" }, c)))),
      el("tbody", {}, rows.map((cells) => el("tr", {},
        cells.map((cell, i) => el("td", { "data-label": columns[i] }, cell)))))));
}

function yesNo(value) {
  return value === null || value === undefined ? na(value) : value ? "yes" : "no";
}

function attestation(a) {
  if (!a) return el("p", {}, `Attestation: ${NOT_AVAILABLE}`);
  return facts([
    ["Source", el("span", {}, code(a.source_sha, 12), a.source_dirty ? " (dirty tree)" : "")],
    ["Image", el("span", {}, a.image_ref || NOT_AVAILABLE, " ", code(a.image_id, 19))],
    ["Helper", `${a.helper_version ?? NOT_AVAILABLE} (required ${a.required_helper ?? NOT_AVAILABLE})`],
    ["Engine", na(a.engine_version)],
    ["Reverse probe", a.probe_ok === null || a.probe_ok === undefined
      ? NOT_AVAILABLE : `${a.probe_ok ? "ok" : "failed"}${a.probe_age_s != null ? `, ${Math.round(a.probe_age_s)} s ago` : ""}`],
    ["Heartbeat", a.heartbeat_age_s == null ? "no beat yet"
      : `${a.heartbeat_age_s.toFixed(1)} s ago${a.heartbeat_stale ? " (stale)" : ""}`],
    ["Ready", el("span", { class: a.ready ? "ok" : "bad" },
      a.ready ? "ready" : `not ready: ${(a.reasons || []).join(", ") || "unknown"}`)],
  ]);
}

function budget(b) {
  if (!b) return el("p", { id: "budget" }, "Memory budget: ", el("span", { class: "na" }, NOT_AVAILABLE));
  const pct = Math.min(100, Math.round((100 * b.used_bytes) / Math.max(1, b.limit_bytes)));
  return el("div", { id: "budget" },
    el("p", {}, `Memory budget: ${(b.used_bytes / MB).toFixed(0)} MiB of ${(b.limit_bytes / MB).toFixed(0)} MiB (${pct}%)`),
    el("meter", { min: "0", max: String(b.limit_bytes), value: String(b.used_bytes),
                  "aria-label": "resident memory against the budget" }));
}

function queue(q) {
  if (!q) return el("p", { id: "queue" }, "Queue: ", el("span", { class: "na" }, NOT_AVAILABLE));
  return el("div", { id: "queue" }, el("p", {}, `Queue: ${q.depth} waiting`),
    q.entries.length ? table("Waiting jobs", Object.keys(q.entries[0]),
      q.entries.map((e) => Object.values(e).map(String)), "queue-table") : null);
}

function chatLink(user, chat) {
  return el("a", { href: `#/chat/${encodeURIComponent(user)}/${encodeURIComponent(chat)}` }, chat);
}

export async function hostPage(view) {
  const h = await getJSON("/v1/host");
  const residents = h.residents.length
    ? table("Resident CLI processes", ["User", "Chat", "Member", "Runtime", "Container", "In turn", "Idle", "Memory"],
      h.residents.map((r) => [r.user_id, chatLink(r.user_id, r.chat_id), r.member_id, r.runtime,
                              code(r.container_id, 12), yesNo(r.in_turn), `${r.idle_s} s`,
                              r.memory_bytes == null ? na(null) : `${(r.memory_bytes / MB).toFixed(1)} MiB`]),
      "residents-table")
    : el("p", {}, "No resident processes.");
  const sandboxes = h.sandboxes.length
    ? table(`Sandboxes (${h.sandboxes.length} of ${h.sandboxes_total})`,
      ["User", "Chat", "State", "Container", "Image", "Volume", "Residents", "Last used"],
      h.sandboxes.map((s) => [s.user_id, chatLink(s.user_id, s.chat_id),
                              el("span", {}, el("span", { class: `state state-${s.state}` }, s.state),
                                 s.lost_reason ? ` (${s.lost_reason})` : ""),
                              el("span", {}, s.container_name, " ", code(s.container_id, 12)),
                              code(s.image_id, 19), na(s.volume), String(s.residents), when(s.last_used_at)]),
      "sandboxes-table")
    : el("p", {}, "No sandboxes.");
  clear(view).append(
    el("h2", { class: "page-title", id: "host-title" }, `Host ${h.host_id}`),
    el("div", { class: "host-layout" },
      el("section", { class: "panel", "aria-labelledby": "attestation-title" },
        el("h3", { id: "attestation-title" }, "Attestation"), attestation(h.attestation)),
      el("section", { class: "panel", "aria-labelledby": "residents-title" },
        el("h3", { id: "residents-title" }, "Residents"), budget(h.budget), residents, queue(h.queue)),
      el("section", { class: "panel wide", "aria-labelledby": "sandboxes-title" },
        el("h3", { id: "sandboxes-title" }, "Sandboxes"), sandboxes)));
}
