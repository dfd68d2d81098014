//! Naming the imports a plugin needs that a host does not provide, for the refusal.
//!
//! wasmtime's type check stops at the first import it cannot satisfy and its `Linker`
//! offers no look-up by name, so this asks it repeatedly: on a copy of the linker,
//! each import named by a failed check is stubbed with functions that trap (as
//! `define_unknown_imports_as_traps` does) and the check runs again, until it passes.
//! Only diagnostics use the copy.

use wasmtime::component::types::{ComponentFunc, ComponentItem};
use wasmtime::component::{Component, Linker, ResourceType, Val};
use wasmtime::Engine;

/// The names of `component`'s imports that `linker` does not satisfy (missing, or of
/// another type), in the component's order. Empty if none could be named.
pub(crate) fn unsatisfied_imports<T: 'static>(linker: &Linker<T>, component: &Component) -> Vec<String> {
    let engine = linker.engine().clone();
    let ty = component.component_type();
    let imports: Vec<(&str, ComponentItem)> = ty.imports(&engine).map(|(name, import)| (name, import.ty)).collect();
    let mut probe = linker.clone();
    probe.allow_shadowing(true);
    let mut named = Vec::new();
    // Each round names one more import, so this ends after at most one per import.
    for _ in 0..=imports.len() {
        let Err(e) = probe.instantiate_pre(component) else { break };
        let message = e.to_string();
        let failing = imports.iter().find(|(name, _)| message.contains(&format!("`{name}`")) && !named.iter().any(|n| n == name));
        let Some((name, item)) = failing else { break };
        named.push(name.to_string());
        if stub(&mut probe, &engine, name, item).is_err() {
            break;
        }
    }
    named
}

/// Define `name` in `linker` as `item`'s shape with functions that trap.
fn stub<T: 'static>(linker: &mut Linker<T>, engine: &Engine, name: &str, item: &ComponentItem) -> wasmtime::Result<()> {
    fn trap<T>(_: wasmtime::StoreContextMut<'_, T>, _: ComponentFunc, _: &[Val], _: &mut [Val]) -> wasmtime::Result<()> {
        wasmtime::bail!("not provided by this host")
    }
    match item {
        ComponentItem::ComponentInstance(instance) => {
            let mut stubbed = linker.instance(name)?;
            for (export, item) in instance.exports(engine) {
                match item.ty {
                    ComponentItem::ComponentFunc(_) => stubbed.func_new(export, trap::<T>)?,
                    ComponentItem::Resource(_) => stubbed.resource(export, ResourceType::host::<()>(), |_, _| Ok(()))?,
                    _ => {}
                }
            }
        }
        ComponentItem::ComponentFunc(_) => linker.root().func_new(name, trap::<T>)?,
        ComponentItem::Resource(_) => linker.root().resource(name, ResourceType::host::<()>(), |_, _| Ok(()))?,
        _ => wasmtime::bail!("cannot stub {name}"),
    }
    Ok(())
}
