//! Link diagnostics: every import of a component the linker cannot satisfy, by name
//! (wasmtime's own check stops at the first).

use super::*;

/// Every top-level import of `component` that `linker` cannot satisfy (absent, or of
/// another type), by name. wasmtime's check stops at the first one (`error`), so each
/// one found is stubbed in a scratch copy of the linker and the check runs again.
pub(super) fn unresolved_imports(
    linker: &Linker<PluginState>,
    component: &Component,
    error: &wasmtime::Error,
) -> Vec<String> {
    let (engine, ty) = (component.engine(), component.component_type());
    let mut probe = linker.clone();
    probe.allow_shadowing(true);
    let mut missing: Vec<String> = Vec::new();
    let mut next = first_unresolved(error);
    while let Some(name) = next.take() {
        if missing.contains(&name) {
            break; // stubbing it did not satisfy the check: report what was found
        }
        let stubbed = ty
            .get_import(engine, &name)
            .is_some_and(|import| stub(&mut probe.root(), &name, &import.ty, engine).is_ok());
        missing.push(name);
        if !stubbed || missing.len() >= ty.imports(engine).len() {
            break;
        }
        if let Err(e) = probe.instantiate_pre(component) {
            next = first_unresolved(&e);
        }
    }
    missing
}

/// The import named in `instantiate_pre`'s error: "component imports instance `NAME`,
/// but a matching implementation was not found in the linker".
fn first_unresolved(error: &wasmtime::Error) -> Option<String> {
    error.chain().find_map(|cause| {
        let text = cause.to_string();
        let rest = text.strip_prefix("component imports ")?;
        Some(rest.split('`').nth(1)?.to_string())
    })
}

/// A resource type for stubs; never instantiated.
struct StubResource;

/// Define `name` (of type `item`) in `linker` with functions that fail if called: only
/// to let the link check go on past it.
fn stub(
    linker: &mut wasmtime::component::LinkerInstance<'_, PluginState>,
    name: &str,
    item: &wasmtime::component::types::ComponentItem,
    engine: &Engine,
) -> wasmtime::Result<()> {
    use wasmtime::component::types::ComponentItem;
    match item {
        ComponentItem::ComponentFunc(func) if func.async_() => linker
            .func_new_concurrent(name, |_, _, _, _| {
                Box::pin(async { wasmtime::bail!("a link-check stub") })
            }),
        ComponentItem::ComponentFunc(_) => {
            linker.func_new(name, |_, _, _, _| wasmtime::bail!("a link-check stub"))
        }
        ComponentItem::Resource(_) => linker.resource(
            name,
            wasmtime::component::ResourceType::host::<StubResource>(),
            |_, _| Ok(()),
        ),
        ComponentItem::ComponentInstance(instance) => {
            let mut inner = linker.instance(name)?;
            instance
                .exports(engine)
                .try_for_each(|(export, item)| stub(&mut inner, export, &item.ty, engine))
        }
        // Types need no definition; modules and components are not imported by plugins.
        ComponentItem::Type(_) => Ok(()),
        _ => wasmtime::bail!("{name}: not a kind of import the link check can stub"),
    }
}
