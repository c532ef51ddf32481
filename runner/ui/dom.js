// Building DOM nodes. Every piece of data goes in as text (textContent), never as markup.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function clear(node) {
  while (node.firstChild) node.firstChild.remove();
  return node;
}

export const NOT_AVAILABLE = "not available";

export function na(value) {
  return value === null || value === undefined || value === "" ? el("span", { class: "na" }, NOT_AVAILABLE) : value;
}

export function short(value, n = 12) {
  if (!value) return "∅";
  return value.length <= n ? value : value.slice(0, n) + "…";
}

export function code(value, n) {
  return el("code", { title: value || null }, n ? short(value, n) : (value || "∅"));
}

export function ms(value) {
  return `${(value ?? 0).toLocaleString("en-US")} ms`;
}

export function when(iso) {
  if (!iso) return NOT_AVAILABLE;
  const d = new Date(iso);
  return el("time", { datetime: iso }, d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z"));
}

// A definition list from [label, value] pairs; a value may be a node or text.
export function facts(pairs, cls = "facts") {
  return el("dl", { class: cls }, pairs.filter(Boolean).map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}
