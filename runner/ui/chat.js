// The chat page: sandbox, members and their fork tree, and the timeline of turns.

import { chatPath, getJSON } from "./api.js";
import { clear, code, el, facts, na, when } from "./dom.js";
import { badge, renderDiagnosis, renderTurn } from "./timeline.js";

const PAGE = 50;

export function chatForm(user = "", chat = "") {
  const form = el("form", { class: "chat-form", id: "chat-form" },
    el("label", { for: "chat-user" }, "User id"),
    el("input", { id: "chat-user", name: "user", required: true, value: user, spellcheck: "false" }),
    el("label", { for: "chat-chat" }, "Chat id"),
    el("input", { id: "chat-chat", name: "chat", required: true, value: chat, spellcheck: "false" }),
    el("button", { type: "submit" }, "Open chat"));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const u = form.elements.user.value.trim();
    const c = form.elements.chat.value.trim();
    location.hash = `#/chat/${encodeURIComponent(u)}/${encodeURIComponent(c)}`;
  });
  return el("section", { class: "panel", "aria-labelledby": "chat-form-title" },
    el("h2", { id: "chat-form-title" }, "Open a chat"), form);
}

// The latest receipt of each member among the loaded turns (CLI and helper versions, image).
function latestByMember(turns) {
  const out = new Map();
  for (const t of turns) if (t.receipt) out.set(t.member_id, t.receipt);
  return out;
}

export function memberTree(members, latest = new Map()) {
  const ids = new Set(members.map((m) => m.member_id));
  const children = new Map();
  const roots = [];
  for (const m of members) {
    if (m.forked_from && ids.has(m.forked_from)) {
      if (!children.has(m.forked_from)) children.set(m.forked_from, []);
      children.get(m.forked_from).push(m);
    } else roots.push(m);
  }
  const node = (m) => {
    const r = latest.get(m.member_id);
    const kids = children.get(m.member_id) || [];
    return el("li", { class: "member", "data-member": m.member_id },
      el("p", { class: "member-head" }, el("strong", {}, m.member_id), ` · ${m.runtime} `,
         m.last_status ? badge(m.last_status) : null,
         m.lost_reason ? el("span", { class: "reason" }, " lost: ", el("strong", {}, m.lost_reason)) : null),
      facts([
        m.forked_from ? ["Forked from", m.forked_from] : null,
        ["Locator", m.locator ? code(m.locator.id) : "∅"],
        ["Settled turns", String(m.settled_turns)],
        ["Resident", m.resident ? "yes" : "no"],
        ["Last outcome", na(m.last_outcome)],
        ["CLI", na(r && r.cli_version)],
      ], "facts small"),
      kids.length ? el("ul", { class: "tree" }, kids.map(node)) : null);
  };
  return el("ul", { class: "tree tree-root" }, roots.map(node));
}

// The helper version the chat's sandbox last reported (a refused turn reports none).
function lastHelper(turns) {
  for (const t of [...turns].reverse()) {
    const v = t.receipt && t.receipt.sandbox && t.receipt.sandbox.helper_version;
    if (v) return v;
  }
  return null;
}

function sandboxFacts(sb, turns) {
  if (!sb) return el("p", {}, "No sandbox recorded for this chat.");
  return facts([
    ["State", el("span", {}, el("span", { class: `state state-${sb.state}` }, sb.state),
                 sb.lost_reason ? ` (${sb.lost_reason})` : "")],
    ["Container", el("span", { class: "stack" }, code(sb.container_name), code(sb.container_id, 12))],
    ["Image", code(sb.image_id, 19)],
    ["Volume", na(sb.volume)],
    ["Helper", na(lastHelper(turns))],
    ["Last used", when(sb.last_used_at)],
  ]);
}

async function diagnose(user, chat, turn, button, out) {
  const open = button.getAttribute("aria-expanded") === "true";
  if (open) {
    out.hidden = true;
    button.setAttribute("aria-expanded", "false");
    return;
  }
  clear(out).append(el("p", {}, "Diagnosing…"));
  out.hidden = false;
  button.setAttribute("aria-expanded", "true");
  try {
    const d = await getJSON(`${chatPath(user, chat)}/inspect?turn=${turn.index}`);
    clear(out).append(renderDiagnosis(d));
  } catch (err) {
    clear(out).append(el("p", { class: "error" }, `Diagnosis failed: ${err.message}`));
  }
}

// Arrow keys move between turns; Tab reaches every turn and its button in order.
function arrowKeys(list) {
  list.addEventListener("keydown", (e) => {
    if (!e.target.classList.contains("turn") || !["ArrowDown", "ArrowUp", "Home", "End"].includes(e.key)) return;
    const rows = [...list.querySelectorAll(":scope > .turn")];
    const i = rows.indexOf(e.target);
    const j = { ArrowDown: i + 1, ArrowUp: i - 1, Home: 0, End: rows.length - 1 }[e.key];
    if (rows[j]) { rows[j].focus(); e.preventDefault(); }
  });
}

export async function chatPage(view, user, chat) {
  clear(view).append(chatForm(user, chat));
  if (!user || !chat) return;
  const status = await getJSON(chatPath(user, chat));
  const first = await getJSON(`${chatPath(user, chat)}/turns?limit=${PAGE}`);
  const turns = [...first.turns];
  const latest = latestByMember(turns.length ? turns : (status.last_receipts || []).slice().reverse()
    .map((r) => ({ member_id: r.member_id, receipt: r })));
  const list = el("ol", { class: "timeline", id: "timeline", "aria-label": "Turns" });
  arrowKeys(list);
  const onDiagnose = (turn, button, out) => diagnose(user, chat, turn, button, out);
  const add = (page) => list.append(...page.turns.map((t) => renderTurn(t, { onDiagnose })));
  add(first);
  let cursor = first.next_cursor;
  const more = el("button", { type: "button", id: "more-turns", hidden: !cursor }, "Load more turns");
  more.addEventListener("click", async () => {
    const page = await getJSON(`${chatPath(user, chat)}/turns?limit=${PAGE}&cursor=${encodeURIComponent(cursor)}`);
    add(page);
    cursor = page.next_cursor;
    more.hidden = !cursor;
  });
  const side = el("div", { class: "side" },
    el("section", { class: "panel", "aria-labelledby": "sandbox-title" },
      el("h3", { id: "sandbox-title" }, "Sandbox"), sandboxFacts(status.sandbox, turns)),
    el("section", { class: "panel", "aria-labelledby": "members-title" },
      el("h3", { id: "members-title" }, "Members"),
      status.members.length ? memberTree(status.members, latest) : el("p", {}, "No members.")));
  const main = el("section", { class: "panel timeline-panel", "aria-labelledby": "timeline-title" },
    el("h3", { id: "timeline-title" }, `Timeline · ${first.total} turn${first.total === 1 ? "" : "s"}`),
    turns.length ? list : el("p", {}, "No turns yet."), more);
  view.append(el("h2", { class: "page-title", id: "chat-title" }, `Chat ${chat}`,
                 el("span", { class: "muted" }, ` of user ${user}`)),
              el("div", { class: "chat-layout" }, side, main));
}

